"""The attention op against the numpy reference (always) and MAX 26.7's own paged
flash attention (on a subset), on random ragged batches that mix prefill, chunked
prefill and decode rows over random non-contiguous page tables.

Tolerances (outputs are O(1): softmax-weighted means of N(0, 1) values):

- float32: |mokv - numpy float64| <= 2e-5 + 2e-5 * |numpy|. The kernel
  accumulates in float32 over up to several thousand tokens.
- bfloat16: q, K and V hold exact bfloat16 values, so the reference sees the
  same inputs; the output is rounded to bfloat16 (relative step 2^-8), so
  |mokv - numpy| <= 1e-3 + 8e-3 * |numpy| (one rounding step plus float32 noise).
- MAX's own kernel: float32 as above. In bfloat16 it rounds intermediate
  results to bfloat16 (measured: median error 1-2% of the value, up to 0.06
  absolute on prefill rows), so in bfloat16 both MAX against numpy and mokv
  against MAX are held to |a - b| <= 0.1 + 0.05 * |b|; mokv itself is still
  held to the tight bound against numpy.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pytest
from max.driver import Buffer
from max.dtype import DType
from max.engine import InferenceSession, Model

from mokv_reference import bfloat16
from mokv_reference.attention import attention as reference_attention
from mokv_reference.max_attention import MaxAttentionShape, MaxPagedAttention
from tests.attention_graph import NUM_LAYERS

TOLERANCE = {DType.float32: (2e-5, 2e-5), DType.bfloat16: (1e-3, 8e-3)}  # (atol, rtol)
MAX_TOLERANCE = {DType.float32: TOLERANCE[DType.float32], DType.bfloat16: (0.1, 0.05)}


@dataclass
class Batch:
    """A ragged step over a cache that already holds every row's context.

    Float data is float32; for bfloat16 cases it holds exact bfloat16 values."""

    layout: str
    dtype: DType
    blocks: np.ndarray
    cache_lengths: np.ndarray
    lookup_table: np.ndarray
    row_offsets: np.ndarray
    q: np.ndarray


def _random_values(rng: np.random.Generator, shape: tuple[int, ...], dtype: DType) -> np.ndarray:
    values = rng.standard_normal(shape, dtype=np.float32)
    return bfloat16.from_bits(bfloat16.to_bits(values)) if dtype == DType.bfloat16 else values


def make_batch(
    rng: np.random.Generator,
    layout: str,
    dtype: DType,
    rows: list[tuple[int, int]],
    n_q_heads: int,
    n_kv_heads: int,
    head_dim: int,
    block_len: int,
) -> Batch:
    """`rows` lists (cached tokens, new tokens) per sequence. Paged: each
    sequence gets randomly chosen, non-contiguous pages (the last one partly
    used), unused lookup entries point at the null page, and spare pages hold
    noise. Continuous: rows get a random permutation of slots of `block_len`."""
    cached = np.array([c for c, _ in rows], np.uint32)
    new = np.array([n for _, n in rows], np.int64)
    context = cached + new
    batch = len(rows)
    if layout == "paged":
        pages = np.maximum(-(-context // block_len), 1)
        num_pages = int(pages.sum()) + 3
        order = rng.permutation(num_pages)
        lookup = np.full((batch, int(pages.max()) + 1), num_pages, np.uint32)  # null page
        taken = 0
        for row, count in enumerate(pages):
            lookup[row, :count] = order[taken : taken + count]
            taken += count
        num_blocks = num_pages + 1
    else:
        assert context.max() <= block_len
        num_blocks = batch + 2
        lookup = rng.permutation(num_blocks)[:batch].astype(np.uint32)
    blocks = _random_values(rng, (num_blocks, 2, NUM_LAYERS, block_len, n_kv_heads, head_dim), dtype)
    q = _random_values(rng, (int(new.sum()), n_q_heads, head_dim), dtype)
    offsets = np.concatenate([[0], np.cumsum(new)]).astype(np.uint32)
    return Batch(layout, dtype, blocks, cached, lookup, offsets, q)


def _buffer(values: np.ndarray, dtype: DType) -> Buffer:
    if dtype == DType.bfloat16:
        return Buffer.from_numpy(bfloat16.to_bits(values)).view(DType.bfloat16)
    return Buffer.from_numpy(np.ascontiguousarray(values))


def _to_numpy(out: Buffer, dtype: DType) -> np.ndarray:
    if dtype == DType.bfloat16:
        return bfloat16.from_bits(out.view(DType.uint16).to_numpy())
    return out.to_numpy()


def batch_summary(b: Batch) -> np.ndarray | bool:
    """The cache's fourth input for `b`, exact, as the managers build it: paged
    `max_lengths` (most new tokens of a row, longest context including them),
    or continuous batching's `is_cache_empty`."""
    new = np.diff(b.row_offsets)
    if b.layout == "paged":
        return np.array([[new.max(initial=0), (b.cache_lengths + new).max(initial=0)]], np.uint32)
    return not b.cache_lengths.any()


def run_mokv(
    model: Model, b: Batch, layer: int, scale: float, window: int = 0, summary: np.ndarray | bool | None = None
) -> np.ndarray:
    """Runs the attention graph on `b`, with `summary` (default: the exact one)
    as the cache's fourth input."""
    summary = batch_summary(b) if summary is None else summary
    (out,) = model.execute(
        _buffer(b.blocks, b.dtype),
        Buffer.from_numpy(b.cache_lengths),
        Buffer.from_numpy(b.lookup_table),
        Buffer.from_numpy(summary) if b.layout == "paged" else Buffer.scalar(summary, DType.bool),
        _buffer(b.q, b.dtype),
        Buffer.from_numpy(b.row_offsets),
        Buffer.from_numpy(np.array(layer, np.uint32)),
        Buffer.from_numpy(np.array(scale, np.float32)),
        Buffer.from_numpy(np.array(window, np.uint32)),
    )
    return _to_numpy(out, b.dtype)


def expected(b: Batch, layer: int, scale: float, window: int = 0) -> np.ndarray:
    return reference_attention(b.blocks, layer, b.q, b.row_offsets, b.cache_lengths, b.lookup_table, scale, window)


def assert_close(actual: np.ndarray, desired: np.ndarray, dtype: DType, tolerance=TOLERANCE) -> None:
    atol, rtol = tolerance[dtype]
    np.testing.assert_allclose(actual, desired, atol=atol, rtol=rtol)


# Mixed batches: (cached, new) per row. Prefill from empty, chunked prefill on a
# cached prefix, decode at short and long contexts, an idle row, a 1-token context.
MIXED_ROWS = [(0, 37), (211, 1), (130, 70), (0, 1), (1500, 1), (9, 0), (45, 2), (700, 1)]

# (layout, dtype, n_q_heads, n_kv_heads, head_dim, block_len): GQA 1:1, 3:1,
# 4:1 and 8:1; head_dim 64 and 128; page sizes 1, 16, 128, 256.
CASES = [
    ("paged", DType.float32, 4, 4, 64, 1),
    ("paged", DType.float32, 9, 3, 64, 16),
    ("paged", DType.float32, 16, 4, 128, 128),
    ("paged", DType.float32, 6, 2, 128, 256),
    ("paged", DType.bfloat16, 9, 3, 64, 16),
    ("paged", DType.bfloat16, 32, 8, 128, 128),
    ("paged", DType.bfloat16, 8, 1, 64, 1),
    ("continuous", DType.float32, 12, 3, 64, 1536),
    ("continuous", DType.float32, 8, 1, 128, 1536),
    ("continuous", DType.bfloat16, 4, 2, 128, 1536),
]


def _case_id(case) -> str:
    layout, dtype, hq, hkv, d, block = case
    return f"{layout}-{dtype.name}-{hq}x{hkv}x{d}-block{block}"


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_mixed_batch_matches_numpy(case, attention_graph):
    layout, dtype, hq, hkv, d, block = case
    rng = np.random.default_rng(hq * 1000 + d + block)
    rows = [MIXED_ROWS[i] for i in rng.permutation(len(MIXED_ROWS))]
    b = make_batch(rng, layout, dtype, rows, hq, hkv, d, block)
    layer = int(rng.integers(0, NUM_LAYERS))
    scale = 1 / math.sqrt(d) * float(rng.uniform(0.5, 2.0))
    out = run_mokv(attention_graph(layout, dtype), b, layer, scale)
    assert_close(out, expected(b, layer, scale), dtype)


@pytest.mark.parametrize("dtype", [DType.float32, DType.bfloat16])
@pytest.mark.parametrize("rows", [[(6000, 1)], [(3000, 1), (4500, 1), (20, 1)]], ids=["one", "three"])
def test_long_decode_split_over_workers(rows, dtype, attention_graph):
    """Few long decode rows are split over several work items and merged."""
    rng = np.random.default_rng(len(rows))
    b = make_batch(rng, "paged", dtype, rows, 8, 2, 128, 16)
    scale = 1 / math.sqrt(128)
    out = run_mokv(attention_graph("paged", dtype), b, 1, scale)
    assert_close(out, expected(b, 1, scale), dtype)


@pytest.mark.parametrize("dtype", [DType.float32, DType.bfloat16])
@pytest.mark.parametrize(
    ("rows", "window"),
    [([(6000, 5), (2500, 1)], 0), ([(6000, 5), (2500, 1)], 700), ([(3000, 40), (5000, 3), (20, 1)], 0)],
    ids=["chunk5", "chunk5-window", "chunk40-mixed"],
)
def test_short_chunks_on_long_prefix_split_over_workers(rows, window, dtype, attention_graph):
    """A short chunk on a long cached prefix makes one large prefill item per
    KV head: those items are split over their context and merged, beside
    unsplit prefill and decode items in the same batch. (With 1 to 16 workers
    the first chunk's items each hold over a quarter of the batch's work.)"""
    rng = np.random.default_rng(len(rows) + window)
    b = make_batch(rng, "paged", dtype, rows, 9, 3, 64, 16)
    scale = 0.125
    out = run_mokv(attention_graph("paged", dtype), b, 0, scale, window)
    assert_close(out, expected(b, 0, scale, window), dtype)


def test_long_prefill_chunk_on_cached_prefix(attention_graph):
    rng = np.random.default_rng(5)
    b = make_batch(rng, "paged", DType.float32, [(2500, 150), (0, 300)], 9, 3, 64, 128)
    scale = 0.125
    out = run_mokv(attention_graph("paged", DType.float32), b, 0, scale)
    assert_close(out, expected(b, 0, scale), DType.float32)


def test_large_scores_stay_stable(attention_graph):
    """Scores of a few hundred over 3000 tokens: without the running max, exp
    overflows. Rounding a float32 score of size ~300 moves it by ~1e-5, which
    the exponential turns into the same relative error in the weights, hence the
    wider bound."""
    rng = np.random.default_rng(9)
    b = make_batch(rng, "paged", DType.float32, [(3000, 1), (40, 30)], 4, 2, 64, 16)
    b.q *= 4
    scale = 3.0
    out = run_mokv(attention_graph("paged", DType.float32), b, 0, scale)
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out, expected(b, 0, scale), atol=5e-4, rtol=5e-4)


@pytest.mark.parametrize("layout", ["paged", "continuous"])
@pytest.mark.parametrize("window", [1, 5, 100])
def test_sliding_window(layout, window, attention_graph):
    rng = np.random.default_rng(window)
    rows = [(0, 40), (300, 1), (150, 60), (3, 1), (64, 0)]
    b = make_batch(rng, layout, DType.float32, rows, 6, 3, 64, 16 if layout == "paged" else 512)
    out = run_mokv(attention_graph(layout, DType.float32), b, 1, 0.125, window)
    assert_close(out, expected(b, 1, 0.125, window), DType.float32)


def test_rejects_page_outside_block_tensor(attention_graph):
    rng = np.random.default_rng(1)
    b = make_batch(rng, "paged", DType.float32, [(40, 1), (10, 5)], 4, 2, 64, 16)
    bad_page = b.blocks.shape[0] + 7
    b.lookup_table[1, 0] = bad_page
    with pytest.raises(ValueError, match=f"row 1: page id {bad_page} for token 0"):
        run_mokv(attention_graph("paged", DType.float32), b, 0, 0.125)


def test_rejects_heads_not_multiple_of_kv_heads(attention_graph):
    rng = np.random.default_rng(2)
    b = make_batch(rng, "paged", DType.float32, [(5, 3)], 4, 3, 64, 16)
    with pytest.raises(ValueError, match="q has 4 heads, not a positive multiple of the cache's 3 KV heads"):
        run_mokv(attention_graph("paged", DType.float32), b, 0, 0.125)


def test_rejects_offsets_that_disagree_with_q(attention_graph):
    rng = np.random.default_rng(3)
    b = make_batch(rng, "continuous", DType.float32, [(5, 3), (2, 2)], 4, 2, 64, 64)
    b.row_offsets[2] = 6
    with pytest.raises(ValueError, match="input_row_offsets ends at 6 but there are 5 new tokens"):
        run_mokv(attention_graph("continuous", DType.float32), b, 0, 0.125)


def test_rejects_bad_layer(attention_graph):
    rng = np.random.default_rng(4)
    b = make_batch(rng, "paged", DType.float32, [(5, 1)], 4, 2, 64, 16)
    with pytest.raises(ValueError, match=f"layer_idx {NUM_LAYERS} out of range"):
        run_mokv(attention_graph("paged", DType.float32), b, NUM_LAYERS, 0.125)


def _two_row_batch(layout: str) -> Batch:
    """Row 0: 10 cached tokens and 1 new; row 1: 5 cached and 3 new."""
    return make_batch(np.random.default_rng(6), layout, DType.float32, [(10, 1), (5, 3)], 4, 2, 64, 16)


@pytest.mark.parametrize(
    ("max_lengths", "message"),
    [
        ([[2, 100]], r"row 1 has 3 new tokens but max_lengths\[0, 0\] is 2"),
        ([[3, 10]], r"row 0 has 10 cached \+ 1 new = 11 tokens but max_lengths\[0, 1\] is 10"),
        (np.zeros((0, 2)), r"max_lengths has shape \[0, 2\], not \[num_steps >= 1, 2\]"),
    ],
    ids=["new-tokens", "context", "no-rows"],
)
def test_rejects_batch_beyond_max_lengths(max_lengths, message, attention_graph):
    b = _two_row_batch("paged")
    with pytest.raises(ValueError, match=message):
        run_mokv(attention_graph("paged", DType.float32), b, 0, 0.125, summary=np.array(max_lengths, np.uint32))


def test_rejects_cached_rows_when_is_cache_empty(attention_graph):
    b = _two_row_batch("continuous")
    with pytest.raises(ValueError, match="is_cache_empty is true but row 0 has cache_length 10"):
        run_mokv(attention_graph("continuous", DType.float32), b, 0, 0.125, summary=True)


def test_fresh_prompts_with_is_cache_empty(attention_graph):
    rng = np.random.default_rng(8)
    b = make_batch(rng, "continuous", DType.float32, [(0, 20), (0, 1), (0, 0), (0, 7)], 6, 3, 64, 64)
    assert batch_summary(b) is True
    out = run_mokv(attention_graph("continuous", DType.float32), b, 1, 0.125)
    assert_close(out, expected(b, 1, 0.125), DType.float32)


@pytest.mark.parametrize(
    ("rows", "max_lengths"),
    [
        ([(40, 1), (300, 1), (7, 0), (0, 1)], [[16, 4096]]),
        ([(2000, 1), (100, 30), (3, 0)], [[64, 8192], [1, 8193]]),
    ],
    ids=["short-decode", "long-mixed"],
)
def test_upper_bounds_in_max_lengths_change_nothing(rows, max_lengths, attention_graph):
    """`max_lengths` may hold upper bounds (`BatchCharacteristics`) and rows
    for later steps. The planner passes that exact bounds let it skip (no
    prefill rows when at most one token is new, no splits when no context
    exceeds `MIN_SPLIT`) must not change a bit of the output."""
    rng = np.random.default_rng(len(rows))
    b = make_batch(rng, "paged", DType.float32, rows, 8, 2, 64, 16)
    model = attention_graph("paged", DType.float32)
    exact = run_mokv(model, b, 0, 0.125)
    bounded = run_mokv(model, b, 0, 0.125, summary=np.array(max_lengths, np.uint32))
    np.testing.assert_array_equal(bounded, exact)
    assert_close(exact, expected(b, 0, 0.125), DType.float32)


# MAX's kernel is compiled per static shape (~2-3 minutes each on 2 cores):
# one float32 graph in the default run (SmolLM2's 3:1 GQA), a bfloat16 one
# marked slow.
MAX_SHAPES = {
    DType.float32: MaxAttentionShape(DType.float32, NUM_LAYERS, 9, 3, 64, 16, 0.125),
    DType.bfloat16: MaxAttentionShape(DType.bfloat16, NUM_LAYERS, 32, 8, 128, 128, 1 / math.sqrt(128)),
}


@pytest.fixture(scope="session")
def max_attention(session: InferenceSession):
    """MAX's own paged attention, one compiled graph per shape for the session."""
    kernels: dict[MaxAttentionShape, MaxPagedAttention] = {}

    def get(shape: MaxAttentionShape) -> MaxPagedAttention:
        if shape not in kernels:
            kernels[shape] = MaxPagedAttention.compile(session, shape)
        return kernels[shape]

    return get


@pytest.mark.parametrize(
    "dtype", [DType.float32, pytest.param(DType.bfloat16, marks=pytest.mark.slow)], ids=lambda d: d.name
)
def test_mixed_batch_matches_max_kernel(dtype, attention_graph, max_attention):
    shape = MAX_SHAPES[dtype]
    rng = np.random.default_rng(11)
    rows = [(0, 37), (211, 1), (130, 70), (0, 1), (2000, 1), (45, 2), (700, 1), (9, 0)]
    b = make_batch(rng, "paged", dtype, rows, shape.n_q_heads, shape.n_kv_heads, shape.head_dim, shape.page_size)
    layer = 1
    kernel = max_attention(shape)
    theirs = _to_numpy(
        kernel(
            kernel.inputs(
                _buffer(b.blocks, dtype), b.cache_lengths, b.lookup_table, b.row_offsets, _buffer(b.q, dtype), layer
            )
        ),
        dtype,
    )
    ours = run_mokv(attention_graph("paged", dtype), b, layer, shape.scale)
    reference = expected(b, layer, shape.scale)
    assert_close(theirs, reference, dtype, MAX_TOLERANCE)  # the comparison itself is sound
    assert_close(ours, reference, dtype)
    assert_close(ours, theirs, dtype, MAX_TOLERANCE)
