"""The quantized cache's ops against the numpy model of 8-bit storage
(`mokv_reference.quant`): store quantizes, gather dequantizes (or returns the
codes and scales), attention reads codes with their scales.

Bounds, all derived from the formats:

- store: every granule's scale is its largest finite magnitude over the
  largest code (to float32 rounding), and every element's code is the
  nearest one to x / scale: its error is at most half the gap between the
  two codes around it (`code_step`), plus float32 noise in x / scale.
- attention against float64 numpy on the dequantized cache: the kernel's
  inputs are then exactly the reference's, so the float32 bound of the
  unquantized tests holds (2e-5 + 2e-5 * |ref|); bfloat16 queries and outputs
  as there (1e-3 + 8e-3 * |ref|).
- attention against the float32 cache: reported, and held to what 8-bit
  storage allows on N(0, 1) data (mean error under 1% for int8 and 5% for
  float8 of the output's scale).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from max.driver import Buffer
from max.dtype import DType

from mokv.graph import GraphGroup, hadamard
from mokv_reference import cache as layout
from mokv_reference import quant as ref
from mokv_reference.attention import attention as reference_attention
from tests.support.compile_once import compiled_together
from tests.support.kv_quantization_cases import (
    ATTENTION_CASES,
    FORMATS,
    ROWS,
    Cache,
    assert_nearest_codes,
    empty_cache,
    quantized_batch,
    rows_buffer,
    to_numpy,
    u32,
)
from tests.support.quantized_graphs import GRAPH_DTYPE, NUM_LAYERS, build_attention, build_store_gather

QUANTIZED_GRAPHS = [
    *(("store_gather", GRAPH_DTYPE[fmt], DType.float32, "paged") for fmt in FORMATS),
    *(("attention", GRAPH_DTYPE[fmt], DType.float32, layout) for fmt in FORMATS for layout in ("paged", "continuous")),
    ("attention", GRAPH_DTYPE["float8_e4m3fn"], DType.bfloat16, "paged"),
]
"""(graph, graph dtype, model dtype, layout) of every graph these tests run."""


@pytest.fixture(scope="session")
def quantized_graphs(session, kernels):
    """`get(graph, graph dtype, model dtype, layout)`: a `QUANTIZED_GRAPHS` graph; the
    family compiled together on first use."""

    def build(graph: str, graph_dtype: DType, dtype: DType, layout: str, group: GraphGroup):
        if graph == "store_gather":
            return build_store_gather(graph_dtype, dtype, kernels, group=group)
        return build_attention(graph_dtype, dtype, kernels, layout, group=group)

    return compiled_together(session, build, QUANTIZED_GRAPHS)


@pytest.fixture(scope="session")
def quantized_store_gather(quantized_graphs):
    """`get(graph dtype, model dtype)`: the paged store/gather graph."""
    return lambda graph_dtype, dtype: quantized_graphs("store_gather", graph_dtype, dtype, "paged")


@pytest.fixture(scope="session")
def quantized_attention(quantized_graphs):
    """`get(graph dtype, model dtype, layout="paged")`: the attention graph."""
    return lambda graph_dtype, dtype, layout="paged": quantized_graphs("attention", graph_dtype, dtype, layout)


def _gathered(cache: Cache, store_gather, keys, values, cache_lengths, offsets, layer, rows, positions):
    """Runs store then gather; returns (dequantized keys, key codes, key scales)."""
    model = store_gather(GRAPH_DTYPE[cache.fmt], DType.float32)
    buffers = cache.buffers()
    deq, codes, scales = model.execute(
        *buffers,
        Buffer.from_numpy(cache_lengths),
        Buffer.from_numpy(cache.lookup_table),
        rows_buffer(keys, DType.float32),
        rows_buffer(values, DType.float32),
        Buffer.from_numpy(offsets),
        u32(layer),
        Buffer.from_numpy(rows),
        Buffer.from_numpy(positions),
    )
    cache.codes[...] = buffers[0].to_numpy().view(cache.codes.dtype)
    cache.scales[...] = buffers[1].to_numpy()
    code_bits = codes.to_numpy().view(cache.codes.dtype)
    return deq.to_numpy(), code_bits, scales.to_numpy()


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("granules", [1, 2])
def test_store_quantizes_each_granule_to_its_nearest_codes(fmt, granules, quantized_store_gather):
    """Per-token scales: a ragged batch of new rows, at arbitrary positions
    of reused pages, comes back as the nearest codes under the exact scale."""
    rng = np.random.default_rng(granules)
    heads, d, page = 3, 64, 16
    cache = empty_cache(rng, fmt, 3, 4, page, heads, d, granules, 1)
    cache_lengths = np.array([0, 17, 40], np.uint32)
    new = np.array([20, 1, 9])
    offsets = np.concatenate([[0], np.cumsum(new)]).astype(np.uint32)
    keys = rng.standard_normal((new.sum(), heads, d)).astype(np.float32) * rng.uniform(0.01, 100, (new.sum(), 1, 1))
    keys = keys.astype(np.float32)
    values = rng.standard_normal(keys.shape).astype(np.float32)
    rows = np.repeat(np.arange(3), new).astype(np.uint32)
    positions = np.concatenate([np.arange(c, c + n) for c, n in zip(cache_lengths, new, strict=True)]).astype(np.uint32)
    deq, codes, scales = _gathered(
        cache, quantized_store_gather, keys, values, cache_lengths, offsets, 1, rows, positions
    )

    expected_scales = ref.granule_scales(keys, d // granules, fmt)
    np.testing.assert_allclose(scales, expected_scales, rtol=1e-6)
    assert_nearest_codes(keys, codes, scales, fmt)
    np.testing.assert_allclose(deq, ref.dequantize(codes, scales, fmt), rtol=1e-6)


@pytest.mark.parametrize("fmt", FORMATS)
def test_store_saturates_and_maps_nan_to_zero(fmt, quantized_store_gather):
    rng = np.random.default_rng(0)
    cache = empty_cache(rng, fmt, 1, 1, 16, 1, 16, 1, 1)
    keys = np.ones((3, 1, 16), np.float32)
    keys[0, 0, :4] = [np.inf, -np.inf, np.nan, 2.0]
    keys[1] = np.nan  # nothing finite: scale 0, every code 0
    keys[2, 0, 0] = 1e30
    offsets = np.array([0, 3], np.uint32)
    positions = np.arange(3, dtype=np.uint32)
    deq, codes, scales = _gathered(
        cache, quantized_store_gather, keys, keys, np.zeros(1, np.uint32), offsets, 0, np.zeros(3, np.uint32), positions
    )
    limit = ref.CODE_MAX[fmt]
    np.testing.assert_allclose(scales[:, 0, 0], [2.0 / limit, 0.0, 1e30 / limit], rtol=1e-6)
    np.testing.assert_array_equal(ref.decode(codes[0, 0, :4], fmt), [limit, -limit, 0, limit])
    assert (ref.decode(codes[1], fmt) == 0).all() and (deq[1] == 0).all()
    assert np.isfinite(deq).all()


@pytest.mark.parametrize("fmt", FORMATS)
def test_store_codes_span_every_magnitude(fmt, quantized_store_gather):
    """Magnitudes from the granule's largest down to 2^-20 of it, both signs,
    with exact midpoints between codes: float8's subnormal codes (below 2^-6
    of a code unit) and its ties (to the even mantissa) included."""
    rng = np.random.default_rng(5)
    d = 64
    cache = empty_cache(rng, fmt, 1, 2, 16, 1, d, 1, 1)
    rows = 16
    keys = np.empty((rows, 1, d), np.float32)
    keys[:, 0, 0] = 448.0 if fmt == "float8_e4m3fn" else 127.0  # the scale is then 1
    magnitudes = np.exp2(rng.uniform(-20, 8.8, (rows, d - 1)))
    midpoints = ref.decode(np.arange(1, 0x7E, dtype=np.uint8), fmt) if fmt == "float8_e4m3fn" else np.arange(127.0)
    midpoints = (midpoints[:-1] + midpoints[1:]) / 2
    magnitudes[:, : d // 2] = rng.choice(midpoints, (rows, d // 2))
    keys[:, 0, 1:] = np.minimum(magnitudes, keys[0, 0, 0]) * rng.choice([-1.0, 1.0], (rows, d - 1))
    offsets = np.array([0, rows], np.uint32)
    positions = np.arange(rows, dtype=np.uint32)
    _, codes, scales = _gathered(
        cache,
        quantized_store_gather,
        keys,
        keys,
        np.zeros(1, np.uint32),
        offsets,
        0,
        np.zeros(rows, np.uint32),
        positions,
    )
    np.testing.assert_array_equal(scales, 1.0)
    expected, _ = ref.quantize(keys.astype(np.float64), d, fmt)
    if fmt == "float8_e4m3fn":  # exact: ties to even, subnormals
        np.testing.assert_array_equal(codes.view(np.uint8), expected.view(np.uint8))
    else:  # int8 rounds ties away from zero, numpy to even: they differ only at .5
        differ = codes != expected
        assert (np.abs(keys[differ] - np.round(keys[differ] - 0.5) - 0.5) < 1e-6).all()


@pytest.mark.parametrize("fmt", FORMATS)
def test_growing_scale_block_requantizes_the_tokens_it_holds(fmt, quantized_store_gather):
    """Scales per block of 4 tokens, filled one decode token at a time with
    magnitudes growing 4x per token: each new token raises the block's scale
    and the tokens already there are requantized under it. Each token's
    error is then at most half a code step under every scale it was rounded
    with (for float8 these do not shrink with the scale: the error compounds,
    which is why one scale per token is the default)."""
    rng = np.random.default_rng(1)
    heads, d, page, per_block = 2, 32, 8, 4
    cache = empty_cache(rng, fmt, 1, 2, page, heads, d, 1, per_block)
    growth = 4.0 ** np.arange(10)
    tokens = (rng.standard_normal((10, heads, d)) * growth[:, None, None]).astype(np.float32)
    no_rows = np.zeros(0, np.uint32)
    for t in range(10):
        one = tokens[t : t + 1]
        offsets = np.array([0, 1], np.uint32)
        _gathered(cache, quantized_store_gather, one, one, np.array([t], np.uint32), offsets, 0, no_rows, no_rows)
    empty = tokens[:0]
    deq, _, scales = _gathered(
        cache,
        quantized_store_gather,
        empty,
        empty,
        np.array([10], np.uint32),
        np.array([0, 0], np.uint32),
        0,
        np.zeros(10, np.uint32),
        np.arange(10, dtype=np.uint32),
    )
    limit = ref.CODE_MAX[fmt]
    for t in range(10):
        block_start = t - t % per_block
        block_end = min(block_start + per_block, 10)
        final = np.abs(tokens[block_start:block_end]).max(axis=(0, 2)) / limit
        np.testing.assert_allclose(scales[t, :, 0], final, rtol=1e-6)
        # The scales token t was rounded under: the block's after each store from t on.
        history = [np.abs(tokens[block_start : u + 1]).max(axis=(0, 2)) / limit for u in range(t, block_end)]
        allowed = sum(ref.code_step(tokens[t] / s[:, None], fmt) * s[:, None] / 2 for s in history)
        error = np.abs(deq[t] - tokens[t])
        assert (error <= allowed * 1.01 + 1e-6).all(), f"token {t}: error {error.max()} over {allowed.max()}"


def _run_attention(model, cache, cached, offsets, q, summary, q_dtype, layer, scale):
    (out,) = model.execute(
        *cache.buffers(),
        Buffer.from_numpy(cached),
        Buffer.from_numpy(cache.lookup_table),
        Buffer.from_numpy(summary),
        rows_buffer(q, q_dtype),
        Buffer.from_numpy(offsets),
        u32(layer),
        Buffer.from_numpy(np.array(scale, np.float32)),
        u32(0),
    )
    return to_numpy(out, q_dtype)


@pytest.mark.parametrize("case", ATTENTION_CASES, ids=lambda c: "-".join(str(x) for x in c))
def test_attention_reads_codes_with_their_scales(case, quantized_attention):
    """Decode and prefill rows over a quantized cache equal float64 attention
    over the numpy dequantization of the same cache."""
    fmt, q_dtype, group, d, page, granules, per_block = case
    rng = np.random.default_rng(d + page + granules)
    heads = 2
    cache, cached, offsets, q, summary = quantized_batch(
        rng, fmt, ROWS, heads, group, d, page, granules, per_block, q_dtype
    )
    scale = 1 / math.sqrt(d)
    out = _run_attention(
        quantized_attention(GRAPH_DTYPE[fmt], q_dtype), cache, cached, offsets, q, summary, q_dtype, 1, scale
    )
    expected = reference_attention(cache.dequantized(), 1, q, offsets, cached, cache.lookup_table, scale)
    atol, rtol = (2e-5, 2e-5) if q_dtype == DType.float32 else (1e-3, 8e-3)
    np.testing.assert_allclose(out, expected, atol=atol, rtol=rtol)


@pytest.mark.parametrize("fmt", FORMATS)
def test_continuous_layout_reads_codes_with_their_scales(fmt, quantized_attention):
    """The same op over continuous-batching slots (a `[batch]` lookup table,
    `is_cache_empty` as the summary): one slot of `max_seq_len` tokens per row."""
    rng = np.random.default_rng(3)
    heads, group, d, slot = 2, 3, 64, 512
    rows = [(0, 40), (300, 1), (100, 20)]
    cache = empty_cache(rng, fmt, 1, 5, slot, heads, d, 1, 1)  # blocks of 512 tokens: the slots
    cache.lookup_table = rng.permutation(5)[: len(rows)].astype(np.uint32)
    if fmt == "int8":
        cache.codes[...] = rng.integers(-127, 128, cache.codes.shape, dtype=np.int8)
    else:
        cache.codes[...] = ref.nearest_e4m3(rng.standard_normal(cache.codes.shape) * 100)
    cache.scales[...] = rng.uniform(0.002, 0.03, cache.scales.shape).astype(np.float32)
    cached = np.array([c for c, _ in rows], np.uint32)
    new = np.array([n for _, n in rows])
    offsets = np.concatenate([[0], np.cumsum(new)]).astype(np.uint32)
    q = rng.standard_normal((new.sum(), heads * group, d)).astype(np.float32)
    (out,) = quantized_attention(GRAPH_DTYPE[fmt], DType.float32, "continuous").execute(
        *cache.buffers(),
        Buffer.from_numpy(cached),
        Buffer.from_numpy(cache.lookup_table),
        Buffer.scalar(False, DType.bool),
        rows_buffer(q, DType.float32),
        Buffer.from_numpy(offsets),
        u32(0),
        Buffer.from_numpy(np.array(0.125, np.float32)),
        u32(0),
    )
    expected = reference_attention(cache.dequantized(), 0, q, offsets, cached, cache.lookup_table, 0.125)
    np.testing.assert_allclose(out.to_numpy(), expected, atol=2e-5, rtol=2e-5)


def _error_against_float32_cache(fmt, store_gather, attention, keys, values, q, rows) -> float:
    """Mean |attention over the quantized cache - over a float64 copy of the
    same keys and values| / mean |output|, heads of 3 queries per KV head."""
    rng = np.random.default_rng(11)
    heads, d, page = keys.shape[1], keys.shape[2], 16
    cache = empty_cache(rng, fmt, len(rows), 20, page, heads, d, 1, 1)
    new = np.array([n for _, n in rows])
    offsets = np.concatenate([[0], np.cumsum(new)]).astype(np.uint32)
    cached = np.zeros(len(rows), np.uint32)
    rows_idx = np.zeros(0, np.uint32)
    _gathered(cache, store_gather, keys, values, cached, offsets, 0, rows_idx, rows_idx)
    summary = np.array([[new.max(), new.max()]], np.uint32)
    graph = attention(GRAPH_DTYPE[fmt], DType.float32)
    out = _run_attention(graph, cache, cached, offsets, q, summary, DType.float32, 0, 0.125)
    full = np.zeros((cache.codes.shape[0], 2, NUM_LAYERS, page, heads, d), np.float64)
    layout.store(full, 0, keys, values, offsets, cached, cache.lookup_table)
    exact = reference_attention(full, 0, q, offsets, cached, cache.lookup_table, 0.125)
    return float(np.abs(out - exact).mean() / np.abs(exact).mean())


@pytest.mark.parametrize("fmt", FORMATS)
def test_attention_error_against_the_float32_cache(fmt, quantized_store_gather, quantized_attention, capsys):
    """The same keys and values stored quantized and kept in float32: the
    attention outputs differ by what 8-bit storage costs (reported)."""
    rng = np.random.default_rng(7)
    heads, group, d = 3, 3, 64
    rows = [(0, 300), (0, 1)]
    keys, values = rng.standard_normal((2, 301, heads, d)).astype(np.float32)
    q = rng.standard_normal((301, heads * group, d)).astype(np.float32)
    error = _error_against_float32_cache(fmt, quantized_store_gather, quantized_attention, keys, values, q, rows)
    with capsys.disabled():
        print(f"\n{fmt}: mean |quantized - float32 cache| / mean |output| = {error:.4f}")
    assert error < {"int8": 0.01, "float8_e4m3fn": 0.05}[fmt]


@pytest.mark.parametrize("fmt", FORMATS)
def test_rotated_keys_lose_less_to_outlier_channels(fmt, quantized_store_gather, quantized_attention, capsys):
    """Keys and queries with a few channels 30x the rest (as real models'
    keys have): the same attention computed over Hadamard-rotated queries and
    keys (`rotate_keys`) loses less to 8-bit keys than over the plain ones.
    Values are +-1, which both formats store exactly, so the error is the keys'."""
    rng = np.random.default_rng(5)
    heads, group, d = 3, 3, 64
    rows = [(0, 200), (0, 1)]
    keys = rng.standard_normal((201, heads, d)).astype(np.float32)
    values = rng.choice(np.float32([-1, 1]), (201, heads, d))
    q = rng.standard_normal((201, heads * group, d)).astype(np.float32)
    loud = [3, 17, 40]
    keys[..., loud] *= 30
    q[..., loud] *= 3
    h = hadamard(d)
    plain = _error_against_float32_cache(fmt, quantized_store_gather, quantized_attention, keys, values, q, rows)
    rotated = _error_against_float32_cache(
        fmt, quantized_store_gather, quantized_attention, keys @ h, values, q @ h, rows
    )
    with capsys.disabled():
        print(f"\n{fmt} with outlier key channels: error {plain:.4f} plain, {rotated:.4f} rotated")
    # int8's one step per head shrinks with the outliers' spread (about 3x
    # here); float8's error is relative to each element, so it gains less.
    assert rotated < {"int8": 0.5, "float8_e4m3fn": 0.9}[fmt] * plain
