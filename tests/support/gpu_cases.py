"""The attention cases the GPU kernels are checked on, shared by the emulator
tests and the tests on a GPU: the CPU suite's batches (`tests.support.attention_cases`,
and `tests.support.kv_quantization_cases` for 8-bit caches), built the same way
with the same seeds, and how close a GPU kernel's output must be to the
reference."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pytest
from max.dtype import DType

from mokv_reference import bfloat16
from mokv_reference.attention import attention as reference_attention
from tests.support import attention_cases as cpu_attention
from tests.support import kv_quantization_cases as cpu_quantized


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


def rounded_to_bfloat16(values: np.ndarray) -> np.ndarray:
    """`values` rounded to the nearest bfloat16, as float64."""
    return bfloat16.from_bits(bfloat16.to_bits(values.astype(np.float32))).astype(np.float64)


def p_rounded_attention(*args, **kwargs) -> np.ndarray:
    """What a tensor-core kernel computes, modelled in float64 (the arguments
    are the reference attention's): every softmax weight `exp(s - max)`
    rounded to bfloat16 before it multiplies the values (the P V product
    takes bfloat16 operands), while the sum that normalises is of the
    unrounded weights (the kernel sums them in float32)."""
    return reference_attention(*args, weights_in_products=rounded_to_bfloat16, **kwargs)


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
        model = p_rounded_attention(b.blocks, layer, b.q, b.row_offsets, b.cache_lengths, b.lookup_table, scale, window)
        atol += 2 * float(np.abs(model - exact).max())
    np.testing.assert_allclose(out, exact, atol=atol, rtol=rtol)


@dataclass
class QuantizedAttention:
    """One attention call (layer 1) over a quantized cache: its output and inputs."""

    out: np.ndarray
    cache: cpu_quantized.Cache
    q: np.ndarray
    q_dtype: DType
    row_offsets: np.ndarray
    cache_lengths: np.ndarray
    scale: float

    def reference(self, values: np.ndarray, model=reference_attention) -> np.ndarray:
        """`model`'s attention (float64) over `values` laid out as the cache's codes."""
        return model(values, 1, self.q, self.row_offsets, self.cache_lengths, self.cache.lookup_table, self.scale)

    def assert_close(self, tensor_cores: bool, warpgroup: bool = False) -> None:
        """Float64 attention over the numpy dequantization of the cache, within
        the CPU suite's tolerance; bfloat16 queries on tensor cores within
        the tolerance widened by twice the error of rounding the softmax
        weights (`p_rounded_attention`), against the dequantization rounded
        to bfloat16 (codes widened times their scales in shared memory), or
        as it is with one scale per head row on `mma.sync` (not `warpgroup`
        products): codes widened exactly to float16, each score times its
        key's scale, each weight times its value's before it is rounded."""
        on_tensor_cores = self.q_dtype == DType.bfloat16 and tensor_cores
        values = self.cache.dequantized()
        exact_codes = self.cache.scales.shape[-1] == 1 and not warpgroup
        if on_tensor_cores and not exact_codes:
            values = rounded_to_bfloat16(values)
        exact = self.reference(values)
        atol, rtol = cpu_attention.TOLERANCE[self.q_dtype]
        if on_tensor_cores:
            atol += 2 * float(np.abs(self.reference(values, p_rounded_attention) - exact).max())
        np.testing.assert_allclose(self.out, exact, atol=atol, rtol=rtol)


def on_prefill_kernel(monkeypatch: pytest.MonkeyPatch, kernel: str, run):
    """`run()` with `MOKV_PREFILL_KERNEL=kernel` (`mma` or `wgmma`); skips
    `wgmma` where the GPU has no warpgroup MMA (the op says so)."""
    monkeypatch.setenv("MOKV_PREFILL_KERNEL", kernel)
    try:
        return run()
    except ValueError as error:
        if "no warpgroup MMA" in str(error):
            pytest.skip(f"not a Hopper GPU: {error}")
        raise
