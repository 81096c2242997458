"""The op-graph families the tests compile, each a builder and the keys of its graphs, on
any device: the fixtures compile each family as one `GraphGroup` (on the CPU, and on a GPU
for the GPU tests), and `tools/compile_gpu_graphs.py` compiles the GPU ones for a GPU
target on a machine without one (MAX's virtual device mode)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from max.dtype import DType
from max.graph import DeviceRef, Graph

from mokv.graph import GraphGroup
from tests.support.attention_graph import build_attention_graph
from tests.support.compile_once import Key
from tests.support.kv_quantization_cases import FORMATS
from tests.support.quantized_graphs import GRAPH_DTYPE, build_attention, build_store_gather
from tests.support.store_gather import build_store_gather_graph

LAYOUT_DTYPE_KEYS: list[Key] = [
    (layout, dtype) for layout in ("paged", "continuous") for dtype in (DType.float32, DType.bfloat16)
]
"""The (layout, dtype) of each graph in the attention and store/gather families."""

QUANTIZED_KEYS: list[Key] = [
    (kind, GRAPH_DTYPE[fmt], dtype)
    for kind in ("store", "attention")
    for fmt in FORMATS
    for dtype in (DType.float32, DType.bfloat16)
]
"""(kind, graph dtype, model dtype) of every quantized graph the GPU tests run: keys,
values and queries of both dtypes over both 8-bit formats."""


@dataclass(frozen=True)
class GraphFamily:
    """Graphs compiled together: `build(*key, group=group)` builds the graph of `key`."""

    build: Callable[..., Graph]
    keys: list[Key]


def attention_family(kernels: Path, device: DeviceRef) -> GraphFamily:
    """The attention op alone, per (layout, dtype)."""
    return GraphFamily(
        lambda layout, dtype, group: build_attention_graph(layout, dtype, kernels, device, group), LAYOUT_DTYPE_KEYS
    )


def store_gather_family(kernels: Path, device: DeviceRef) -> GraphFamily:
    """Store then gather, per (layout, dtype)."""
    return GraphFamily(
        lambda layout, dtype, group: build_store_gather_graph(layout, dtype, kernels, device, group),
        LAYOUT_DTYPE_KEYS,
    )


def quantized_family(kernels: Path, device: DeviceRef) -> GraphFamily:
    """The quantized cache's store/gathers and attention, per `QUANTIZED_KEYS` key."""

    def build(kind: str, graph_dtype: DType, dtype: DType, group: GraphGroup) -> Graph:
        if kind == "store":
            return build_store_gather(graph_dtype, dtype, kernels, device, group)
        return build_attention(graph_dtype, dtype, kernels, device=device, group=group)

    return GraphFamily(build, QUANTIZED_KEYS)
