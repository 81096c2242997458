"""Bytes restored from every tier equal what the store op wrote, read back
through the gather op of a compiled graph (the path a model's attention takes)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from max.driver import Buffer
from max.dtype import DType

from mokv import KVCacheParams, PagedKVCacheManager, TextContext
from mokv.tiers import KVConnectorConfig
from tests.support.store_gather import HEAD_DIM, N_KV_HEADS, NUM_LAYERS
from tests.support.tiers import shared_tier

PAGE = 8
PROMPT = np.arange(500, 500 + 3 * PAGE + 1)
CACHED = 3 * PAGE


@pytest.fixture(scope="module")
def paged_store_gather(store_gather):
    """The suite's paged float32 store/gather graph (its family shared with tests/mojo)."""
    return store_gather("paged", DType.float32)


def manager(config: KVConnectorConfig | None, host_pages: int = 0, pages: int = 8) -> PagedKVCacheManager:
    params = KVCacheParams(
        DType.float32,
        n_kv_heads=N_KV_HEADS,
        head_dim=HEAD_DIM,
        num_layers=NUM_LAYERS,
        page_size=PAGE,
        enable_prefix_caching=True,
    )
    return PagedKVCacheManager(
        params, None, pages, host_pages, enable_runtime_checks=True, max_batch_size=2, connector_config=config
    )


def _u32(values) -> Buffer:
    return Buffer.from_numpy(np.asarray(values, np.uint32))


def store_prompt(model, m: PagedKVCacheManager, rng: np.random.Generator) -> np.ndarray:
    """Runs the prompt through the store op (random K/V, every layer); returns
    `[layers, 2, tokens, heads, head_dim]` as written."""
    c = TextContext("writer", PROMPT)
    m.claim("writer")
    m.alloc(c)
    inputs = m.runtime_inputs_for_leaf([[c]]).flatten()
    n = len(PROMPT)
    written = rng.standard_normal((NUM_LAYERS, 2, n, N_KV_HEADS, HEAD_DIM)).astype(np.float32)
    for layer in range(NUM_LAYERS):
        keys, values = (Buffer.from_numpy(np.ascontiguousarray(written[layer, kv])) for kv in (0, 1))
        model.execute(*inputs, keys, values, _u32([0, n]), _u32(layer), _u32([0]), _u32([0]))
    c.update(0)
    m.step([[c]])
    m.release("writer")
    return written


def gather_cached(model, m: PagedKVCacheManager) -> np.ndarray:
    """Admits the prompt again and gathers what its cached positions hold."""
    c = TextContext("reader", PROMPT)
    m.claim("reader")
    m.alloc(c)
    assert c.processed_length == CACHED
    inputs = m.runtime_inputs_for_leaf([[c]]).flatten()
    nothing = Buffer.from_numpy(np.zeros((0, N_KV_HEADS, HEAD_DIM), np.float32))
    out = np.empty((NUM_LAYERS, 2, CACHED, N_KV_HEADS, HEAD_DIM), np.float32)
    for layer in range(NUM_LAYERS):
        keys, values = model.execute(
            *inputs, nothing, nothing, _u32([0, 0]), _u32(layer), _u32(np.zeros(CACHED)), _u32(np.arange(CACHED))
        )
        out[layer] = keys.to_numpy(), values.to_numpy()
    m.release("reader")
    return out


@pytest.mark.parametrize("tier", ["host", "disk", "remote"])
def test_restored_bytes_equal_what_was_stored(tier: str, paged_store_gather, tmp_path: Path) -> None:
    rng = np.random.default_rng(3)
    if tier == "host":
        with manager(None, host_pages=8, pages=4) as m:
            written = store_prompt(paged_store_gather, m, rng)
            filler = TextContext("filler", np.arange(9000, 9000 + 4 * PAGE))  # evicts every cached page
            m.claim("filler")
            m.alloc(filler)
            m.get_device_buffer().values[0].to_numpy()[:] = -1.0  # the device copies are gone
            m.release("filler")
            restored = gather_cached(paged_store_gather, m)
            assert m.get_tier_metrics()["host"].hit_pages == 3
    else:
        with shared_tier(tier, tmp_path, "round-trip") as config:
            with manager(config) as first:
                written = store_prompt(paged_store_gather, first, rng)
            with manager(config) as second:
                restored = gather_cached(paged_store_gather, second)
                assert second.get_tier_metrics()[tier].hit_pages == 3
    np.testing.assert_array_equal(restored, written[:, :, :CACHED])
