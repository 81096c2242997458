"""Graphs of the quantized cache's ops, every size symbolic (compiled once per
(graph dtype, model dtype) per session)."""

from __future__ import annotations

from pathlib import Path

from max.dtype import DType
from max.graph import BufferType, DeviceRef, Graph, TensorType, ops

from mokv.graph import GraphGroup, new_graph

CPU_REF = DeviceRef.CPU()
NUM_LAYERS = 2
GRAPH_DTYPE = {"float8_e4m3fn": DType.uint8, "int8": DType.int8}
"""The blocks' graph dtype per code format (float8 codes travel as uint8 bits)."""


def _cache_types(graph_dtype: DType, layout: str, device: DeviceRef) -> list:
    """Blocks, scales, cache lengths and the lookup table: `[batch, pages]`
    (paged) or `[batch]` slots (continuous batching), on `device`."""
    table = ["batch", "pages"] if layout == "paged" else ["batch"]
    return [
        BufferType(graph_dtype, ["blocks", 2, NUM_LAYERS, "page", "heads", "head_dim"], device),
        BufferType(DType.float32, ["blocks", 2, NUM_LAYERS, "scale_rows", "heads", "granules"], device),
        TensorType(DType.uint32, ["batch"], device),
        TensorType(DType.uint32, table, device),
    ]


def _name(base: str, device: DeviceRef) -> str:
    return base + ("" if device == CPU_REF else f"_{device.device_type}")


def _u32(value: int):
    return ops.constant(value, DType.uint32, device=CPU_REF)


def build_store_gather(
    graph_dtype: DType, dtype: DType, kernels: Path, device: DeviceRef = CPU_REF, group: GraphGroup | None = None
) -> Graph:
    """Stores new K/V of a runtime layer, then gathers the requested key rows
    both dequantized and as codes with their scales, on `device` (the layer
    index on the host; in `group` when given)."""
    rows = TensorType(dtype, ["tokens", "heads", "head_dim"], device)
    index = TensorType(DType.uint32, ["n"], device)
    inputs = [
        *_cache_types(graph_dtype, "paged", device),
        rows,
        rows,
        TensorType(DType.uint32, ["batch_plus_one"], device),
        TensorType(DType.uint32, [], CPU_REF),
        index,
        index,
    ]
    name = _name(f"quantized_store_gather_{graph_dtype}_{dtype}", device)
    with new_graph(name, inputs, [kernels], group) as g:
        cache = [g.inputs[0].buffer, g.inputs[1].buffer, g.inputs[2].tensor, g.inputs[3].tensor]
        keys, values, offsets, layer, batch_rows, positions = (v.tensor for v in g.inputs[4:])
        ops.inplace_custom("mokv.store_kv.quantized", device=device, values=[*cache, keys, values, offsets, layer])
        n = batch_rows.shape[0]
        (dequantized,) = ops.inplace_custom(
            "mokv.gather.quantized",
            device=device,
            values=[*cache, batch_rows, positions, layer, _u32(0)],
            out_types=[TensorType(dtype, [n, "heads", "head_dim"], device)],
        )
        codes, scales = ops.inplace_custom(
            "mokv.gather.codes",
            device=device,
            values=[*cache, batch_rows, positions, layer, _u32(0)],
            out_types=[
                TensorType(graph_dtype, [n, "heads", "head_dim"], device),
                TensorType(DType.float32, [n, "heads", "granules"], device),
            ],
        )
        g.output(dequantized.tensor, codes.tensor, scales.tensor)
    return g


def build_attention(
    graph_dtype: DType,
    dtype: DType,
    kernels: Path,
    layout: str = "paged",
    device: DeviceRef = CPU_REF,
    group: GraphGroup | None = None,
) -> Graph:
    """`(cache..., summary, q, offsets, layer, scale, window) -> attention` over a
    quantized cache on `device` (the summary and scalars on the host; in `group`
    when given); the summary is `max_lengths` (paged) or `is_cache_empty`."""
    summary = (
        TensorType(DType.uint32, ["steps", 2], CPU_REF) if layout == "paged" else TensorType(DType.bool, [], CPU_REF)
    )
    inputs = [
        *_cache_types(graph_dtype, layout, device),
        summary,
        TensorType(dtype, ["tokens", "q_heads", "head_dim"], device),
        TensorType(DType.uint32, ["batch_plus_one"], device),
        TensorType(DType.uint32, [], CPU_REF),
        TensorType(DType.float32, [], CPU_REF),
        TensorType(DType.uint32, [], CPU_REF),
    ]
    name = _name(f"quantized_attention_{layout}_{graph_dtype}_{dtype}", device)
    with new_graph(name, inputs, [kernels], group) as g:
        blocks, scales_in = g.inputs[0].buffer, g.inputs[1].buffer
        cache_lengths, lookup, summary, q, offsets, layer, scale, window = (v.tensor for v in g.inputs[2:])
        (out,) = ops.inplace_custom(
            "mokv.attention.quantized",
            device=device,
            values=[blocks, scales_in, cache_lengths, lookup, summary, q, offsets, layer, scale, window],
            out_types=[TensorType(dtype, q.shape, device)],
        )
        g.output(out.tensor)
    return g
