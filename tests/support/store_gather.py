"""Random ragged store/gather batches over random non-contiguous page tables, the
store-then-gather test graph and how to run it: shared by the CPU store/gather
tests, the tier round-trip tests and the GPU tests."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
from max.driver import Buffer
from max.dtype import DType
from max.engine import Model
from max.graph import DeviceRef, Graph, TensorType

from mokv.graph import (
    ContinuousCacheValues,
    GraphGroup,
    PagedCacheValues,
    continuous_input_types,
    gather_kv,
    new_graph,
    paged_input_types,
    store_kv,
)

CPU_REF = DeviceRef.CPU()
N_KV_HEADS, HEAD_DIM, NUM_LAYERS = 3, 16, 3
# numpy stand-ins: bfloat16 is moved around as its raw 16 bits (the ops copy bits).
NUMPY_STORAGE = {DType.float32: np.float32, DType.bfloat16: np.uint16}


@dataclass
class Shape:
    dtype: DType
    num_layers: int = NUM_LAYERS
    n_kv_heads_per_device: int = N_KV_HEADS
    head_dim: int = HEAD_DIM


def _cache_values(layout: str, values):
    return (PagedCacheValues if layout == "paged" else ContinuousCacheValues).from_inputs(values)


def _cache_types(layout: str, dtype: DType, device: DeviceRef):
    """Cache input types with the page size / slot length left symbolic."""
    if layout == "paged":
        return paged_input_types(Shape(dtype), device=device)
    return continuous_input_types(Shape(dtype), device=device)


def _scalar_type() -> TensorType:
    return TensorType(DType.uint32, [], CPU_REF)


def build_store_gather_graph(
    layout: str, dtype: DType, kernels: Path, device: DeviceRef = CPU_REF, group: GraphGroup | None = None
) -> Graph:
    """Stores new K/V of a runtime layer, then gathers the requested rows of that
    layer's keys and values (the ops run in graph order, on one device chain),
    everything but the layer index on `device` (in `group` when given)."""
    rows = TensorType(dtype, ["total_new_tokens", N_KV_HEADS, HEAD_DIM], device)
    offsets = TensorType(DType.uint32, ["batch_plus_one"], device)
    index = TensorType(DType.uint32, ["n"], device)
    inputs = [*_cache_types(layout, dtype, device), rows, rows, offsets, _scalar_type(), index, index]
    name = f"store_gather_{layout}_{dtype}" + ("" if device == CPU_REF else f"_{device.device_type}")
    with new_graph(name, inputs, [kernels], group) as g:
        cache = _cache_values(layout, g.inputs[:4])
        keys, values, row_offsets, layer, batch_rows, positions = (v.tensor for v in g.inputs[4:])
        store_kv(cache, layer, keys, values, row_offsets)
        g.output(*(gather_kv(cache, layer, kv_idx, batch_rows, positions) for kv_idx in (0, 1)))
    return g


@dataclass
class Batch:
    blocks: np.ndarray
    cache_lengths: np.ndarray
    lookup_table: np.ndarray
    row_offsets: np.ndarray
    keys: np.ndarray
    values: np.ndarray


def random_batch(rng: np.random.Generator, layout: str, dtype: DType, block_len: int) -> Batch:
    """A ragged batch with zero-new-token rows, partial last pages and a permuted,
    non-contiguous page table (unused lookup entries hold the null page)."""
    batch = int(rng.integers(1, 6))
    new = rng.integers(0, 3 * block_len + 2, size=batch) * (rng.random(batch) > 0.2)
    if layout == "paged":
        cached = rng.integers(0, 3 * block_len + 1, size=batch)
        pages_needed = -(-(cached + new) // block_len)
        width = int(pages_needed.max()) + 1
        num_pages = int(pages_needed.sum()) + 5
        null_page = num_pages
        order = rng.permutation(num_pages)
        lookup = np.full((batch, width), null_page, np.uint32)
        taken = 0
        for row, count in enumerate(pages_needed):
            lookup[row, :count] = order[taken : taken + count]
            taken += count
        num_blocks = num_pages + 1
    else:
        max_seq = block_len
        new = np.minimum(new, max_seq // 2)
        cached = rng.integers(0, max_seq - new + 1)
        num_blocks = batch + 2
        lookup = rng.permutation(num_blocks)[:batch].astype(np.uint32)
    storage = NUMPY_STORAGE[dtype]
    shape = (num_blocks, 2, NUM_LAYERS, block_len, N_KV_HEADS, HEAD_DIM)
    total = int(new.sum())
    row_shape = (total, N_KV_HEADS, HEAD_DIM)
    if storage is np.uint16:
        blocks, keys, values = (rng.integers(0, 2**16, size=s, dtype=np.uint16) for s in (shape, row_shape, row_shape))
    else:
        blocks, keys, values = (rng.standard_normal(s).astype(np.float32) for s in (shape, row_shape, row_shape))
    offsets = np.concatenate([[0], np.cumsum(new)]).astype(np.uint32)
    return Batch(blocks, cached.astype(np.uint32), lookup, offsets, keys, values)


def to_buffer(array: np.ndarray, dtype: DType) -> Buffer:
    buf = Buffer.from_numpy(np.ascontiguousarray(array))
    return buf.view(dtype) if dtype == DType.bfloat16 else buf


def _cache_buffers(b: Batch, layout: str, dtype: DType) -> list[Buffer]:
    last = (
        Buffer.from_numpy(np.zeros((1, 2), np.uint32))
        if layout == "paged"
        else Buffer.scalar(not b.cache_lengths.any(), DType.bool)
    )
    return [to_buffer(b.blocks, dtype), Buffer.from_numpy(b.cache_lengths), Buffer.from_numpy(b.lookup_table), last]


def u32(x: int) -> Buffer:
    return Buffer.from_numpy(np.array(x, np.uint32))


def to_bits(out: Buffer, dtype: DType) -> np.ndarray:
    return out.view(DType.uint16).to_numpy() if dtype == DType.bfloat16 else out.to_numpy()


def run(model: Model, b: Batch, layout: str, dtype: DType, layer: int, rows: np.ndarray, positions: np.ndarray):
    """Runs store-then-gather; returns the gathered (keys, values) as numpy."""
    keys, values = model.execute(
        *_cache_buffers(b, layout, dtype),
        to_buffer(b.keys, dtype),
        to_buffer(b.values, dtype),
        Buffer.from_numpy(b.row_offsets),
        u32(layer),
        Buffer.from_numpy(rows),
        Buffer.from_numpy(positions),
    )
    return to_bits(keys, dtype), to_bits(values, dtype)


def written_positions(b: Batch) -> tuple[np.ndarray, np.ndarray]:
    """(batch row, position) of every new token, in input order."""
    rows = np.repeat(np.arange(len(b.cache_lengths)), np.diff(b.row_offsets)).astype(np.uint32)
    positions = (b.cache_lengths[rows] + np.arange(len(rows)) - b.row_offsets[rows]).astype(np.uint32)
    return rows, positions


CASES = [
    ("paged", DType.float32, 1),
    ("paged", DType.float32, 3),
    ("paged", DType.float32, 16),
    ("paged", DType.bfloat16, 16),
    ("continuous", DType.float32, 64),
    ("continuous", DType.bfloat16, 64),
]
