"""The paged manager with its block tensor on a GPU: the per-batch tables on
the device (and `max_lengths` on the host) with the right contents, and the
host tier moving real pages device -> host -> device, every byte checked."""

from __future__ import annotations

import numpy as np
import pytest
from max.driver import Buffer, Device
from max.dtype import DType
from max.graph import DeviceRef

from mokv import KVCacheParams, PagedKVCacheManager, TextContext
from tests.support.gpu import needs_gpu

pytestmark = needs_gpu("the paged manager and its host tier with block tensors in GPU memory")

PAGE = 4


def make_manager(gpu_ref: DeviceRef, dtype: DType, pages: int, host_pages: int = 0) -> PagedKVCacheManager:
    params = KVCacheParams(
        dtype, n_kv_heads=2, head_dim=16, num_layers=2, page_size=PAGE, enable_prefix_caching=True, devices=[gpu_ref]
    )
    return PagedKVCacheManager(params, None, pages, host_pages, enable_runtime_checks=True, max_batch_size=8)


def _pages_view(buffer: Buffer) -> Buffer:
    """The block tensor as `[pages, bytes_per_page]` uint8, on its device."""
    pages = buffer.shape[0]
    return buffer.view(DType.uint8, [pages, buffer.num_elements * buffer.dtype.size_in_bytes // pages])


def write_random_pages(m: PagedKVCacheManager, request_id: str, rng: np.random.Generator) -> dict[int, np.ndarray]:
    """Stands in for the model: random bytes into each of the request's pages;
    returns them by block id."""
    blocks = _pages_view(m.get_device_buffer(0).values[0])
    data = blocks.to_numpy()
    written = {}
    for block in m.get_req_blocks(request_id):
        data[block] = rng.integers(0, 256, data.shape[1], dtype=np.uint8)
        written[block] = data[block].copy()
    blocks.inplace_copy_from(Buffer.from_numpy(data))
    blocks.device.synchronize()
    return written


def device_pages(m: PagedKVCacheManager) -> np.ndarray:
    return _pages_view(m.get_device_buffer(0).values[0]).to_numpy()


def test_tables_on_the_device_summary_on_the_host(gpu_ref: DeviceRef, gpu: Device):
    m = make_manager(gpu_ref, DType.float32, pages=32)
    contexts = [TextContext("a", np.arange(10)), TextContext("b", np.arange(100, 103))]
    for c in contexts:
        m.claim(c.request_id)
        m.alloc(c)
    (inputs,) = m.runtime_inputs([contexts]).inputs
    assert not inputs.blocks.device.is_host
    assert not inputs.cache_lengths.device.is_host and not inputs.lookup_table.device.is_host
    assert inputs.max_lengths.device.is_host
    np.testing.assert_array_equal(inputs.cache_lengths.to_numpy(), [0, 0])
    lookup = inputs.lookup_table.to_numpy()
    assert lookup[0, :3].tolist() == m.get_req_blocks("a")
    assert lookup[1, 0] == m.get_req_blocks("b")[0] and lookup[1, 1:].tolist() == [32, 32]  # the null page
    np.testing.assert_array_equal(inputs.max_lengths.to_numpy(), [[10, 10]])


@pytest.mark.parametrize("dtype", [DType.float32, DType.bfloat16], ids=lambda d: d.name)
def test_host_tier_moves_pages_both_ways(dtype, gpu_ref: DeviceRef):
    rng = np.random.default_rng(0)
    m = make_manager(gpu_ref, dtype, pages=4, host_pages=8)
    a = TextContext("a", np.arange(8))  # two full pages, committed to the prefix cache
    m.claim("a")
    m.alloc(a)
    written = write_random_pages(m, "a", rng)
    a.update(0)
    m.step([[a]])
    m.release("a")

    # A request that needs every page evicts a's cached pages to the host (d2h).
    big = TextContext("big", np.arange(100, 116))
    m.claim("big")
    m.alloc(big)
    assert m.get_metrics_aggregated().d2h_blocks_copied == 2
    write_random_pages(m, "big", rng)  # overwrite every device page
    m.release("big")

    # A prefix hit on the host restores a's pages into fresh device pages (h2d).
    again = TextContext("again", np.arange(9))
    m.claim("again")
    m.alloc(again)
    assert m.get_metrics_aggregated().h2d_blocks_copied == 2 and again.processed_length == 8
    pages = device_pages(m)
    first, second, _ = m.get_req_blocks("again")
    original_first, original_second = list(written)
    np.testing.assert_array_equal(pages[first], written[original_first])
    np.testing.assert_array_equal(pages[second], written[original_second])
