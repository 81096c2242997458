"""The attention cases the GPU kernels are checked on, shared by the emulator
tests and the tests on a GPU: the CPU suite's batches (`tests.mojo.test_attention`),
built the same way with the same seeds."""

from __future__ import annotations

import math

import numpy as np
from max.dtype import DType

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
