"""KVCacheBuffer: validation, and the raw-page view offloading relies on."""

from __future__ import annotations

import numpy as np
import pytest
from max.driver import CPU, Buffer
from max.dtype import DType
from max.graph import DeviceRef

from mokv import KVCacheBuffer, KVCacheMemory, KVCacheParams, KVCacheQuantConfig, ReplicatedKVCacheMemory


def page_tensor(pages: int = 3, dtype: DType = DType.float32) -> Buffer:
    return Buffer.zeros([pages, 2, 1, 4, 2, 8], dtype, device=CPU())


def test_pages_are_raw_bytes_of_each_page() -> None:
    values = [page_tensor(), page_tensor()]
    scales = [Buffer.zeros([3, 4], DType.float32, device=CPU()) for _ in range(2)]
    buf = KVCacheBuffer(False, values, scales)
    assert buf.all_buffers == [*values, *scales] and buf.total_num_pages == 3
    units = buf.to_memory()
    assert [type(u) for u in units] == [KVCacheMemory] * 4
    assert [(u.num_physical_pages, u.bytes_per_page) for u in units] == [(3, 2 * 4 * 2 * 8 * 4)] * 2 + [(3, 16)] * 2
    # The views alias the tensors: a page's bytes are that page's elements.
    arr = values[1].to_numpy()
    arr[2] = np.arange(arr[2].size, dtype=np.float32).reshape(arr[2].shape)
    assert units[1].buffer.to_numpy()[2].tobytes() == arr[2].tobytes()
    assert not units[0].buffer.to_numpy().any()
    assert units[0].copies == [units[0].buffer]


def test_replicated_shards_are_one_unit() -> None:
    values = [page_tensor(dtype=DType.bfloat16) for _ in range(3)]
    (unit,) = KVCacheBuffer(True, values).to_memory()
    assert isinstance(unit, ReplicatedKVCacheMemory)
    assert len(unit.peers) == 2 and len(unit.copies) == 3
    assert unit.bytes_per_page == 2 * 4 * 2 * 8 * 2


def test_allocate_follows_params() -> None:
    params = KVCacheParams(
        DType.float32,
        n_kv_heads=4,
        head_dim=8,
        num_layers=2,
        page_size=16,
        devices=[DeviceRef.CPU(), DeviceRef.CPU()],
    )
    buf = KVCacheBuffer.allocate(params, 5, params.devices)
    assert len(buf.values) == 2 and list(buf.values[0].shape) == [6, 2, 2, 16, 2, 8]
    assert (buf.total_num_pages, buf.num_physical_pages, buf.num_null_pages) == (5, 6, 1)
    assert not buf.values[1].to_numpy().any() and not buf.replicates_kv_across_tp
    bare = KVCacheBuffer.allocate(params, 5, params.devices, null_page=False)
    assert bare.total_num_pages == bare.num_physical_pages == 5


@pytest.mark.parametrize("dtype", [DType.float8_e4m3fn, DType.int8])
def test_allocate_adds_zeroed_scales_for_a_quantized_cache(dtype: DType) -> None:
    params = KVCacheParams(
        dtype,
        n_kv_heads=4,
        head_dim=8,
        num_layers=2,
        page_size=16,
        devices=[DeviceRef.CPU(), DeviceRef.CPU()],
        kvcache_quant_config=KVCacheQuantConfig(quantization_granularity=4, tokens_per_scale=8),
    )
    buf = KVCacheBuffer.allocate(params, 5, params.devices)
    assert [(list(b.shape), b.dtype) for b in buf.values] == [([6, 2, 2, 16, 2, 8], dtype)] * 2
    assert buf.scales is not None
    assert [(list(s.shape), s.dtype) for s in buf.scales] == [([6, 2, 2, 2, 2, 2], DType.float32)] * 2
    assert all(s.device == v.device for s, v in zip(buf.scales, buf.values, strict=True))
    assert not any(s.to_numpy().any() for s in buf.scales)
    # Offload units: each shard's values, then each shard's scales, one page per row.
    units = buf.to_memory()
    assert [(u.num_physical_pages, u.bytes_per_page) for u in units] == [(6, 16 * 2 * 2 * 2 * 8)] * 2 + [
        (6, 2 * 2 * 2 * 2 * 2 * 4)
    ] * 2
    assert sum(u.bytes_per_page for u in units[::2]) == params.bytes_per_page
    # A continuous cache's pages are its slots of max_seq_len tokens.
    slots = KVCacheBuffer.allocate(params, 3, params.devices[:1], null_page=False, tokens_per_page=32)
    assert list(slots.values[0].shape) == [3, 2, 2, 32, 2, 8] and list(slots.scales[0].shape) == [3, 2, 2, 4, 2, 2]


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: KVCacheBuffer(False, []), "values must hold at least one buffer"),
        (lambda: KVCacheBuffer(True, [page_tensor()]), "needs at least 2 TP shards, got 1"),
        (
            lambda: KVCacheBuffer(False, [page_tensor(), page_tensor(dtype=DType.bfloat16)]),
            "all values must share a dtype",
        ),
        (
            lambda: KVCacheBuffer(False, [page_tensor(3), page_tensor(4)]),
            "all values must share a shape",
        ),
        (lambda: KVCacheBuffer(False, [page_tensor()], []), "scales has 0 buffers, values has 1"),
        (
            lambda: KVCacheBuffer(False, [page_tensor()], [Buffer.zeros([4, 2], DType.float32)]),
            "scales have 4 pages, values have 3",
        ),
        (lambda: KVCacheMemory(page_tensor()), "must be a 2-D uint8"),
        (lambda: ReplicatedKVCacheMemory(Buffer.zeros([2, 8], DType.uint8)), "at least one peer"),
        (
            lambda: ReplicatedKVCacheMemory(
                Buffer.zeros([2, 8], DType.uint8), peers=[Buffer.zeros([2, 4], DType.uint8)]
            ),
            r"peer 0 has shape \(2, 4\)",
        ),
    ],
)
def test_validation(make, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make()
