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

import numpy as np
import pytest
from max.dtype import DType
from max.engine import InferenceSession

from mokv_reference.max_attention import MaxAttentionShape, MaxPagedAttention
from tests.support.attention_cases import (
    CASES,
    MAX_TOLERANCE,
    MIXED_ROWS,
    Batch,
    assert_close,
    batch_summary,
    case_id,
    expected,
    make_batch,
    run_mokv,
    to_buffer,
    to_numpy,
)
from tests.support.attention_graph import NUM_LAYERS


@pytest.mark.parametrize("case", CASES, ids=case_id)
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


@pytest.mark.parametrize("scale", [0.0, -0.125, float("nan"), float("inf")])
def test_rejects_a_scale_that_is_not_positive_and_finite(scale, attention_graph):
    """The scale is a run-time input of the graph: the op refuses what the
    graph builder's check cannot see."""
    rng = np.random.default_rng(2)
    b = make_batch(rng, "paged", DType.float32, [(5, 3)], 4, 2, 64, 16)
    with pytest.raises(ValueError, match=r"scale \S+ is not a positive finite number"):
        run_mokv(attention_graph("paged", DType.float32), b, 0, scale)


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
    theirs = to_numpy(
        kernel(
            kernel.inputs(
                to_buffer(b.blocks, dtype), b.cache_lengths, b.lookup_table, b.row_offsets, to_buffer(b.q, dtype), layer
            )
        ),
        dtype,
    )
    ours = run_mokv(attention_graph("paged", dtype), b, layer, shape.scale)
    reference = expected(b, layer, shape.scale)
    assert_close(theirs, reference, dtype, MAX_TOLERANCE)  # the comparison itself is sound
    assert_close(ours, reference, dtype)
    assert_close(ours, theirs, dtype, MAX_TOLERANCE)
