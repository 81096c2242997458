"""The attention op alone in a graph, every size symbolic, for the attention
tests of both layouts (compiled once per session by the `attention_graph`
fixture)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from max.dtype import DType
from max.graph import DeviceRef, Graph, TensorType

from mokv.graph import (
    ContinuousCacheValues,
    GraphGroup,
    PagedCacheValues,
    attention,
    continuous_input_types,
    new_graph,
    paged_input_types,
)

CPU_REF = DeviceRef.CPU()
NUM_LAYERS = 2


@dataclass
class SymbolicShape:
    """Cache parameters with every size symbolic: one graph per (layout, dtype)
    serves all head counts, head sizes and page sizes."""

    dtype: DType
    num_layers: int = NUM_LAYERS
    n_kv_heads_per_device: int | str = "n_kv_heads"
    head_dim: int | str = "head_dim"


def build_attention_graph(
    layout: str, dtype: DType, kernels: Path, device: DeviceRef = CPU_REF, group: GraphGroup | None = None
) -> Graph:
    """`(cache..., q, input_row_offsets, layer, scale, window) -> attention`,
    the cache, q and offsets on `device`, the scalars on the host (in `group`
    when given)."""
    shape = SymbolicShape(dtype)
    if layout == "paged":
        cache_types = paged_input_types(shape, device=device)
    else:
        cache_types = continuous_input_types(shape, device=device)
    inputs = [
        *cache_types,
        TensorType(dtype, ["total_new_tokens", "n_q_heads", "head_dim"], device),
        TensorType(DType.uint32, ["batch_plus_one"], device),
        TensorType(DType.uint32, [], CPU_REF),
        TensorType(DType.float32, [], CPU_REF),
        TensorType(DType.uint32, [], CPU_REF),
    ]
    name = f"attention_{layout}_{dtype}" + ("" if device == CPU_REF else f"_{device.device_type}")
    with new_graph(name, inputs, [kernels], group) as g:
        values = PagedCacheValues if layout == "paged" else ContinuousCacheValues
        cache = values.from_inputs(g.inputs[:4])
        q, offsets, layer, scale, window = (v.tensor for v in g.inputs[4:])
        g.output(attention(cache, layer, q, offsets, scale, window))
    return g
