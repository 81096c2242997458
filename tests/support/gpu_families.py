"""The graph families the GPU tests compile, each a builder and the keys of its graphs.
The GPU tests' fixtures compile each family as one `GraphGroup` on a GPU, and
`tools/compile_gpu_graphs.py` compiles the same families for a GPU target on a machine
without one (MAX's virtual device mode)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from max.dtype import DType
from max.graph import DeviceRef, Graph

from mokv.graph import GraphGroup
from mokv_examples.pipeline import MokvCache, pipeline_graph
from mokv_models.attention_backends import DenseCausalAttention
from mokv_models.gguf_model import LlamaCheckpoint
from mokv_models.llama import build_llama_graph
from tests.support.attention_graph import build_attention_graph
from tests.support.compile_once import LAYOUT_DTYPE_KEYS, Key
from tests.support.kv_quantization_cases import FORMATS
from tests.support.quantized_graphs import GRAPH_DTYPE, build_attention, build_store_gather
from tests.support.store_gather import build_store_gather_graph

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


def smollm2_graphs(checkpoint: LlamaCheckpoint, device: DeviceRef, group: GraphGroup) -> str:
    """SmolLM2's pipeline on mokv's paged cache and its dense (no-cache) reference, built
    into `group`; returns the dense graph's name."""
    dense = build_llama_graph(
        checkpoint.config,
        DenseCausalAttention(),
        checkpoint.encodings,
        f"llama_dense_{checkpoint.weight_format}_{device.device_type}",
        device,
        group,
    )
    pipeline_graph(checkpoint, MokvCache(), device_ref=device, group=group)
    return dense.name
