"""Random ragged attention batches over a random page table, run through the
attention test graph and checked against the numpy reference: the cases and
tolerances the CPU attention tests and the GPU tests (on a device and under the
emulator) share. `tests/mojo/test_attention.py` says how the tolerances follow."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from max.driver import Buffer
from max.dtype import DType
from max.engine import Model

from mokv_reference import bfloat16
from mokv_reference.attention import attention as reference_attention
from tests.support.attention_graph import NUM_LAYERS

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


def to_buffer(values: np.ndarray, dtype: DType) -> Buffer:
    if dtype == DType.bfloat16:
        return Buffer.from_numpy(bfloat16.to_bits(values)).view(DType.bfloat16)
    return Buffer.from_numpy(np.ascontiguousarray(values))


def to_numpy(out: Buffer, dtype: DType) -> np.ndarray:
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
        to_buffer(b.blocks, b.dtype),
        Buffer.from_numpy(b.cache_lengths),
        Buffer.from_numpy(b.lookup_table),
        Buffer.from_numpy(summary) if b.layout == "paged" else Buffer.scalar(summary, DType.bool),
        to_buffer(b.q, b.dtype),
        Buffer.from_numpy(b.row_offsets),
        Buffer.from_numpy(np.array(layer, np.uint32)),
        Buffer.from_numpy(np.array(scale, np.float32)),
        Buffer.from_numpy(np.array(window, np.uint32)),
    )
    return to_numpy(out, b.dtype)


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


def case_id(case) -> str:
    layout, dtype, hq, hkv, d, block = case
    return f"{layout}-{dtype.name}-{hq}x{hkv}x{d}-block{block}"
