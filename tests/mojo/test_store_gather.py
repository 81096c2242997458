"""The store and gather ops against the numpy cache model, on random ragged
batches over random non-contiguous page tables, for both layouts and dtypes."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from max.driver import CPU, Buffer
from max.dtype import DType
from max.engine import InferenceSession, Model
from max.graph import DeviceRef, Graph, TensorType

from mokv import KVCacheBuffer, KVCacheParams
from mokv.graph import (
    ContinuousCacheValues,
    PagedCacheValues,
    continuous_input_types,
    gather_kv,
    paged_input_types,
    store_kv,
)
from mokv_reference import cache as ref
from tests.compile_once import compiled_per_key

CPU_REF = DeviceRef.CPU()
N_KV_HEADS, HEAD_DIM, NUM_LAYERS = 3, 16, 3
# numpy stand-ins: bfloat16 is moved around as its raw 16 bits (the ops copy bits).
NUMPY_STORAGE = {DType.float32: np.float32, DType.bfloat16: np.uint16}


@dataclass
class Shape:
    dtype: DType
    num_layers: int = NUM_LAYERS
    n_kv_heads_per_device: int = N_KV_HEADS
    head_dim: int = HEAD_DIM


def _cache_values(layout: str, values):
    return (PagedCacheValues if layout == "paged" else ContinuousCacheValues).from_inputs(values)


def _cache_types(layout: str, dtype: DType, device: DeviceRef):
    """Cache input types with the page size / slot length left symbolic."""
    if layout == "paged":
        return paged_input_types(Shape(dtype), device=device)
    return continuous_input_types(Shape(dtype), device=device)


def _scalar_type() -> TensorType:
    return TensorType(DType.uint32, [], CPU_REF)


def build_store_gather_graph(layout: str, dtype: DType, kernels: Path, device: DeviceRef = CPU_REF) -> Graph:
    """Stores new K/V of a runtime layer, then gathers the requested rows of that
    layer's keys and values (the ops run in graph order, on one device chain),
    everything but the layer index on `device`."""
    rows = TensorType(dtype, ["total_new_tokens", N_KV_HEADS, HEAD_DIM], device)
    offsets = TensorType(DType.uint32, ["batch_plus_one"], device)
    index = TensorType(DType.uint32, ["n"], device)
    inputs = [*_cache_types(layout, dtype, device), rows, rows, offsets, _scalar_type(), index, index]
    name = f"store_gather_{layout}_{dtype}" + ("" if device == CPU_REF else f"_{device.device_type}")
    with Graph(name, input_types=inputs, custom_extensions=[kernels]) as g:
        cache = _cache_values(layout, g.inputs[:4])
        keys, values, row_offsets, layer, batch_rows, positions = (v.tensor for v in g.inputs[4:])
        store_kv(cache, layer, keys, values, row_offsets)
        g.output(*(gather_kv(cache, layer, kv_idx, batch_rows, positions) for kv_idx in (0, 1)))
    return g


@pytest.fixture(scope="session")
def store_gather(session: InferenceSession, kernels: Path):
    """`get(layout, dtype)`: the store/gather graph, compiled once per session on first use."""
    return compiled_per_key(session, lambda layout, dtype: build_store_gather_graph(layout, dtype, kernels))


@dataclass
class Batch:
    blocks: np.ndarray
    cache_lengths: np.ndarray
    lookup_table: np.ndarray
    row_offsets: np.ndarray
    keys: np.ndarray
    values: np.ndarray


def random_batch(rng: np.random.Generator, layout: str, dtype: DType, block_len: int) -> Batch:
    """A ragged batch with zero-new-token rows, partial last pages and a permuted,
    non-contiguous page table (unused lookup entries hold the null page)."""
    batch = int(rng.integers(1, 6))
    new = rng.integers(0, 3 * block_len + 2, size=batch) * (rng.random(batch) > 0.2)
    if layout == "paged":
        cached = rng.integers(0, 3 * block_len + 1, size=batch)
        pages_needed = -(-(cached + new) // block_len)
        width = int(pages_needed.max()) + 1
        num_pages = int(pages_needed.sum()) + 5
        null_page = num_pages
        order = rng.permutation(num_pages)
        lookup = np.full((batch, width), null_page, np.uint32)
        taken = 0
        for row, count in enumerate(pages_needed):
            lookup[row, :count] = order[taken : taken + count]
            taken += count
        num_blocks = num_pages + 1
    else:
        max_seq = block_len
        new = np.minimum(new, max_seq // 2)
        cached = rng.integers(0, max_seq - new + 1)
        num_blocks = batch + 2
        lookup = rng.permutation(num_blocks)[:batch].astype(np.uint32)
    storage = NUMPY_STORAGE[dtype]
    shape = (num_blocks, 2, NUM_LAYERS, block_len, N_KV_HEADS, HEAD_DIM)
    total = int(new.sum())
    row_shape = (total, N_KV_HEADS, HEAD_DIM)
    if storage is np.uint16:
        blocks, keys, values = (rng.integers(0, 2**16, size=s, dtype=np.uint16) for s in (shape, row_shape, row_shape))
    else:
        blocks, keys, values = (rng.standard_normal(s).astype(np.float32) for s in (shape, row_shape, row_shape))
    offsets = np.concatenate([[0], np.cumsum(new)]).astype(np.uint32)
    return Batch(blocks, cached.astype(np.uint32), lookup, offsets, keys, values)


def _buffer(array: np.ndarray, dtype: DType) -> Buffer:
    buf = Buffer.from_numpy(np.ascontiguousarray(array))
    return buf.view(dtype) if dtype == DType.bfloat16 else buf


def _cache_buffers(b: Batch, layout: str, dtype: DType) -> list[Buffer]:
    last = (
        Buffer.from_numpy(np.zeros((1, 2), np.uint32))
        if layout == "paged"
        else Buffer.scalar(not b.cache_lengths.any(), DType.bool)
    )
    return [_buffer(b.blocks, dtype), Buffer.from_numpy(b.cache_lengths), Buffer.from_numpy(b.lookup_table), last]


def _u32(x: int) -> Buffer:
    return Buffer.from_numpy(np.array(x, np.uint32))


def _bits(out: Buffer, dtype: DType) -> np.ndarray:
    return out.view(DType.uint16).to_numpy() if dtype == DType.bfloat16 else out.to_numpy()


def run(model: Model, b: Batch, layout: str, dtype: DType, layer: int, rows: np.ndarray, positions: np.ndarray):
    """Runs store-then-gather; returns the gathered (keys, values) as numpy."""
    keys, values = model.execute(
        *_cache_buffers(b, layout, dtype),
        _buffer(b.keys, dtype),
        _buffer(b.values, dtype),
        Buffer.from_numpy(b.row_offsets),
        _u32(layer),
        Buffer.from_numpy(rows),
        Buffer.from_numpy(positions),
    )
    return _bits(keys, dtype), _bits(values, dtype)


def written_positions(b: Batch) -> tuple[np.ndarray, np.ndarray]:
    """(batch row, position) of every new token, in input order."""
    rows = np.repeat(np.arange(len(b.cache_lengths)), np.diff(b.row_offsets)).astype(np.uint32)
    positions = (b.cache_lengths[rows] + np.arange(len(rows)) - b.row_offsets[rows]).astype(np.uint32)
    return rows, positions


CASES = [
    ("paged", DType.float32, 1),
    ("paged", DType.float32, 3),
    ("paged", DType.float32, 16),
    ("paged", DType.bfloat16, 16),
    ("continuous", DType.float32, 64),
    ("continuous", DType.bfloat16, 64),
]


@pytest.mark.parametrize(("layout", "dtype", "block_len"), CASES)
@pytest.mark.parametrize("seed", range(4))
def test_store_matches_numpy_and_round_trips(layout, dtype, block_len, seed, store_gather):
    rng = np.random.default_rng(seed)
    b = random_batch(rng, layout, dtype, block_len)
    layer = int(rng.integers(0, NUM_LAYERS))
    expected = b.blocks.copy()
    ref.store(expected, layer, b.keys, b.values, b.row_offsets, b.cache_lengths, b.lookup_table)
    rows, positions = written_positions(b)

    keys, values = run(store_gather(layout, dtype), b, layout, dtype, layer, rows, positions)
    # Bit-exact, and everything outside the written rows (other layers, other
    # pages, the null page) untouched: the whole block tensor must match.
    np.testing.assert_array_equal(b.blocks, expected)
    np.testing.assert_array_equal(keys, b.keys)
    np.testing.assert_array_equal(values, b.values)
    np.testing.assert_array_equal(values, ref.gather(b.blocks, layer, 1, b.lookup_table, rows, positions))


def _batch_with_new_tokens(layout: str, seed: int) -> Batch:
    rng = np.random.default_rng(seed)
    block_len = 16 if layout == "paged" else 64
    b = random_batch(rng, layout, DType.float32, block_len)
    while not b.row_offsets[-1]:
        b = random_batch(rng, layout, DType.float32, block_len)
    return b


def test_store_rejects_page_outside_block_tensor(store_gather):
    b = _batch_with_new_tokens("paged", 7)
    row = int(np.argmax(np.diff(b.row_offsets) > 0))
    bad_page = b.blocks.shape[0] + 10
    b.lookup_table[row, int(b.cache_lengths[row]) // 16] = bad_page
    before = b.blocks.copy()
    with pytest.raises(ValueError, match=f"page id {bad_page} for token"):
        run(store_gather("paged", DType.float32), b, "paged", DType.float32, 0, *written_positions(b))
    np.testing.assert_array_equal(b.blocks, before)


def test_store_rejects_bad_layer(store_gather):
    b = _batch_with_new_tokens("continuous", 3)
    with pytest.raises(ValueError, match=f"layer_idx {NUM_LAYERS} out of range for {NUM_LAYERS} layers"):
        run(
            store_gather("continuous", DType.float32), b, "continuous", DType.float32, NUM_LAYERS, *written_positions(b)
        )


def test_continuous_rejects_slot_outside_block_tensor(store_gather):
    b = _batch_with_new_tokens("continuous", 5)
    row = int(np.argmax(np.diff(b.row_offsets) > 0))
    b.lookup_table[row] = 99
    before = b.blocks.copy()
    with pytest.raises(ValueError, match="page id 99"):
        run(store_gather("continuous", DType.float32), b, "continuous", DType.float32, 0, *written_positions(b))
    np.testing.assert_array_equal(b.blocks, before)


def test_gather_rejects_position_past_lookup_row(store_gather):
    b = _batch_with_new_tokens("paged", 11)
    rows = np.zeros(1, np.uint32)
    past_end = np.array([b.lookup_table.shape[1] * 16], np.uint32)
    with pytest.raises(ValueError, match=f"token {past_end[0]} is past"):
        run(store_gather("paged", DType.float32), b, "paged", DType.float32, 0, rows, past_end)


def test_gather_rejects_row_outside_batch(store_gather):
    b = _batch_with_new_tokens("continuous", 13)
    rows = np.array([len(b.cache_lengths)], np.uint32)
    with pytest.raises(ValueError, match=f"batch row {len(b.cache_lengths)} out of range"):
        run(store_gather("continuous", DType.float32), b, "continuous", DType.float32, 0, rows, np.zeros(1, np.uint32))


def test_store_rejects_row_offsets_longer_than_batch(store_gather):
    """Row offsets describing more sequences than the cache has rows would read
    cache lengths past the end of the batch."""
    b = _batch_with_new_tokens("paged", 17)
    positions = written_positions(b)
    b.row_offsets = np.append(b.row_offsets, b.row_offsets[-1])
    before = b.blocks.copy()
    with pytest.raises(ValueError, match=r"input_row_offsets has .* entries but the cache describes"):
        run(store_gather("paged", DType.float32), b, "paged", DType.float32, 0, *positions)
    np.testing.assert_array_equal(b.blocks, before)


def test_first_store_into_a_freshly_allocated_cache_keeps_every_row(store_gather):
    """MAX fills `Buffer.zeros` asynchronously; a store right after allocation
    raced the fill (half of these rows read back as zeros) until
    `KVCacheBuffer.allocate` waited for it."""
    rng = np.random.default_rng(0)
    params = KVCacheParams(DType.float32, N_KV_HEADS, HEAD_DIM, NUM_LAYERS, page_size=16)
    tokens = 2048
    pages = tokens // 16
    lookup = rng.permutation(4 * pages)[: 2 * (pages // 2)].astype(np.uint32).reshape(2, pages // 2)
    keys, values = (rng.standard_normal((tokens, N_KV_HEADS, HEAD_DIM)).astype(np.float32) for _ in range(2))
    rows = np.repeat(np.arange(2), tokens // 2).astype(np.uint32)
    positions = np.tile(np.arange(tokens // 2), 2).astype(np.uint32)
    model = store_gather("paged", DType.float32)
    inputs = [
        Buffer.from_numpy(np.zeros(2, np.uint32)),
        Buffer.from_numpy(lookup),
        Buffer.from_numpy(np.zeros((1, 2), np.uint32)),
        Buffer.from_numpy(keys),
        Buffer.from_numpy(values),
        Buffer.from_numpy(np.array([0, tokens // 2, tokens], np.uint32)),
        _u32(1),
        Buffer.from_numpy(rows),
        Buffer.from_numpy(positions),
    ]
    buffer = KVCacheBuffer.allocate(params, 4 * pages, [CPU_REF])  # the store follows at once
    model.execute(buffer.values[0], *inputs)
    CPU().synchronize()  # whatever the driver still had queued has landed
    blocks = buffer.values[0].to_numpy()
    np.testing.assert_array_equal(ref.gather(blocks, 1, 0, lookup, rows, positions), keys)
    np.testing.assert_array_equal(ref.gather(blocks, 1, 1, lookup, rows, positions), values)
