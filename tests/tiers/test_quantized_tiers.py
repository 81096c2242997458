"""A quantized cache's scales travel with their pages through every tier: the
restored pages' values and scales are byte-equal to what was written, and the
tiers' byte counters count both."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from max.dtype import DType

from mokv import KVCacheQuantConfig, PagedKVCacheManager, TextContext
from mokv.tiers import KVConnectorConfig
from tests.support.tiers import PAGE_SIZE, shared_tier, small_params

PROMPT = np.arange(300, 300 + 3 * PAGE_SIZE + 1)  # three full pages to cache
QUANT = KVCacheQuantConfig(quantization_granularity=4, tokens_per_scale=2)


def quantized_manager(dtype: DType, config: KVConnectorConfig | None = None, host_pages: int = 0):
    params = small_params(dtype=dtype, kvcache_quant_config=QUANT)
    return PagedKVCacheManager(
        params, None, 4, host_pages, enable_runtime_checks=True, max_batch_size=2, connector_config=config
    )


def raw_pages(m: PagedKVCacheManager) -> list[np.ndarray]:
    """Every memory unit of the device cache as `[pages, bytes]` uint8: the
    values, then the scales."""
    return [unit.buffer.to_numpy() for unit in m.get_device_buffer().to_memory()]


def write_prompt(m: PagedKVCacheManager, rng: np.random.Generator) -> list[np.ndarray]:
    """Stands in for the model: distinct random bytes in the prompt's full
    pages of both the values and the scales; commits them; returns what was written."""
    c = TextContext("writer", PROMPT)
    m.claim("writer")
    m.alloc(c)
    pages = m.get_req_blocks("writer")[:3]
    written = []
    for raw in raw_pages(m):
        raw[pages] = rng.integers(1, 256, raw[pages].shape, dtype=np.uint8)
        written.append(raw[pages].copy())
    c.update(0)
    m.step([[c]])
    m.release("writer")
    return written


def read_prompt(m: PagedKVCacheManager) -> list[np.ndarray]:
    """Admits the prompt again (its three pages come from a tier) and returns their bytes."""
    c = TextContext("reader", PROMPT)
    m.claim("reader")
    m.alloc(c)
    m.runtime_inputs([[c]])  # waits for the tier's copies
    assert c.processed_length == 3 * PAGE_SIZE
    pages = m.get_req_blocks("reader")[:3]
    return [raw[pages].copy() for raw in raw_pages(m)]


@pytest.mark.parametrize("dtype", [DType.float8_e4m3fn, DType.int8])
@pytest.mark.parametrize("tier", ["host", "disk", "remote"])
def test_scales_round_trip_with_their_pages(tier: str, dtype: DType, tmp_path: Path) -> None:
    rng = np.random.default_rng(15)
    if tier == "host":
        with quantized_manager(dtype, host_pages=8) as m:
            assert len(raw_pages(m)) == 2  # values, scales
            written = write_prompt(m, rng)
            filler = TextContext("filler", np.arange(9000, 9000 + 4 * PAGE_SIZE))  # evicts every cached page
            m.claim("filler")
            m.alloc(filler)
            for raw in raw_pages(m):
                raw[:] = 0  # the device copies are gone
            m.release("filler")
            restored = read_prompt(m)
            metrics = m.get_tier_metrics()["host"]
            page_bytes = m.params.bytes_per_page
    else:
        with shared_tier(tier, tmp_path, "quantized") as config:
            with quantized_manager(dtype, config) as first:
                written = write_prompt(first, rng)
            with quantized_manager(dtype, config) as second:
                restored = read_prompt(second)
                metrics = second.get_tier_metrics()[tier]
                page_bytes = second.params.bytes_per_page
    for before, after in zip(written, restored, strict=True):
        np.testing.assert_array_equal(after, before)
    # One page by hand: 4 tokens x K,V x 2 layers x 2 heads x 8 one-byte values,
    # then 4 / 2 scale rows x K,V x 2 layers x 2 heads x 8 / 4 float32 scales.
    assert page_bytes == 4 * 2 * 2 * 2 * 8 + 2 * 2 * 2 * 2 * 2 * 4
    assert metrics.hit_pages == 3 and metrics.hit_bytes == 3 * page_bytes


@pytest.mark.parametrize(
    ("dtype", "config"),
    [
        (DType.float8_e4m3fn, QUANT),  # other stored dtype, same bytes
        (DType.int8, KVCacheQuantConfig(quantization_granularity=8, tokens_per_scale=1)),  # same widths
        (DType.int8, replace(QUANT, rotate_keys=True)),  # same layout, keys in another basis
    ],
)
def test_another_quantization_never_reads_the_pages(dtype: DType, config: KVCacheQuantConfig, tmp_path: Path) -> None:
    """Pages stored by an int8 cache with QUANT's scale blocks are no hit for a
    cache whose pages have the same byte widths but mean something else."""
    tiers = KVConnectorConfig(model_id="quantized", disk_offload_dir=tmp_path)
    with quantized_manager(DType.int8, tiers) as writer:
        write_prompt(writer, np.random.default_rng(0))
        widths = [unit.bytes_per_page for unit in writer.get_device_buffer().to_memory()]
    params = small_params(dtype=dtype, kvcache_quant_config=config)
    with PagedKVCacheManager(params, None, 4, max_batch_size=1, connector_config=tiers) as reader:
        assert [unit.bytes_per_page for unit in reader.get_device_buffer().to_memory()] == widths
        c = TextContext("reader", PROMPT)
        reader.claim("reader")
        reader.alloc(c)
        assert c.processed_length == 0
        assert reader.get_tier_metrics()["disk"].rejected_pages == 0  # it never even opened them
