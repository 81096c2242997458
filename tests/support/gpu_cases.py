"""The attention cases the GPU kernels are checked on, shared by the emulator
tests and the tests on a GPU: the CPU suite's batches (`tests.support.attention_cases`),
built the same way with the same seeds, and how close a GPU kernel's output
must be to the reference."""

from __future__ import annotations

import math

import numpy as np
from max.dtype import DType

from mokv_reference import bfloat16
from mokv_reference import cache as ref_cache
from mokv_reference.attention import visible_range
from tests.support import attention_cases as cpu_attention


def mixed_case(case: tuple) -> tuple[cpu_attention.Batch, int, float]:
    """(batch, layer, scale) of one of `cpu_attention.CASES`: the mixed rows
    (prefill, chunked prefill, decode, an idle row) in a random order."""
    layout, dtype, hq, hkv, d, block = case
    rng = np.random.default_rng(hq * 1000 + d + block)
    rows = [cpu_attention.MIXED_ROWS[i] for i in rng.permutation(len(cpu_attention.MIXED_ROWS))]
    b = cpu_attention.make_batch(rng, layout, dtype, rows, hq, hkv, d, block)
    layer = int(rng.integers(0, cpu_attention.NUM_LAYERS))
    return b, layer, 1 / math.sqrt(d) * float(rng.uniform(0.5, 2.0))


def window_case(layout: str, window: int) -> cpu_attention.Batch:
    """A float32 batch for a sliding window of `window` tokens (6/3 heads of 64)."""
    rng = np.random.default_rng(window)
    rows = [(0, 40), (300, 1), (150, 60), (3, 1), (64, 0)]
    block = 16 if layout == "paged" else 512
    return cpu_attention.make_batch(rng, layout, DType.float32, rows, 6, 3, 64, block)


def p_rounded_attention(b: cpu_attention.Batch, layer: int, scale: float, window: int = 0) -> np.ndarray:
    """What a tensor-core kernel computes, modelled in float64: the reference
    attention, but with every softmax weight `exp(s - max)` rounded to
    bfloat16 before it multiplies the values (the P V product takes bfloat16
    operands), while the sum that normalises is of the unrounded weights (the
    kernel sums them in float32)."""
    n_q, n_kv = b.q.shape[1], b.blocks.shape[4]
    kv_head_of = np.arange(n_q) // (n_q // n_kv)
    out = np.zeros(b.q.shape, np.float64)
    for row in range(len(b.cache_lengths)):
        first, last = int(b.row_offsets[row]), int(b.row_offsets[row + 1])
        cached = int(b.cache_lengths[row])
        positions = np.arange(cached + last - first, dtype=np.uint32)
        rows = np.full(len(positions), row, np.uint32)
        keys, values = (
            ref_cache.gather(b.blocks, layer, kv, b.lookup_table, rows, positions).astype(np.float64)[:, kv_head_of]
            for kv in (0, 1)
        )
        for i in range(last - first):
            start, end = visible_range(cached, i, window)
            scores = np.einsum("hd,nhd->hn", b.q[first + i].astype(np.float64), keys[start:end]) * scale
            weights = np.exp(scores - scores.max(axis=1, keepdims=True))
            rounded = bfloat16.from_bits(bfloat16.to_bits(weights.astype(np.float32))).astype(np.float64)
            out[first + i] = np.einsum("hn,nhd->hd", rounded, values[start:end]) / weights.sum(axis=1)[:, None]
    return out


def assert_attention_close(
    out: np.ndarray, b: cpu_attention.Batch, layer: int, scale: float, window: int = 0, tensor_cores: bool = True
) -> None:
    """`out` against the float64 reference: float32 within the CPU suite's
    tolerance; bfloat16 from a tensor-core kernel within it widened by twice
    the largest error that rounding the weights to bfloat16 makes in the
    numpy model (`p_rounded_attention`: the kernel rounds them against a
    running max, a different rounding of the same size)."""
    exact = cpu_attention.expected(b, layer, scale, window)
    atol, rtol = cpu_attention.TOLERANCE[b.dtype]
    if b.dtype == DType.bfloat16 and tensor_cores:
        atol += 2 * float(np.abs(p_rounded_attention(b, layer, scale, window) - exact).max())
    np.testing.assert_allclose(out, exact, atol=atol, rtol=rtol)
