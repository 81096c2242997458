"""The attention kernels the attention benchmarks time, compiled once and kept for the run:
mokv's (one graph per dtype, every size symbolic, from this checkout's kernel package or
another build of it) and MAX's built-in paged attention (one graph per shape, from the
reference package)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from max.driver import CPU, Device
from max.dtype import DType
from max.engine import InferenceSession, Model
from max.graph import DeviceRef, Graph, TensorType

from mokv import graph as mokv_graph
from mokv.kernels import kernel_package
from mokv_examples.bench.attention_cases import NUM_LAYERS, Case
from mokv_examples.bench.references import reference

MAX_KERNELS = "mokv bench attention times MAX's own attention kernels beside mokv's"
"""Why the attention benchmark needs the reference package (its error message says so)."""
DECODE_KERNEL = "MOKV_DECODE_KERNEL"


@dataclass(frozen=True)
class DecodeVariant:
    """A GPU decode chosen by `MOKV_DECODE_KERNEL`, timed beside the default: its blocks take
    `heads_a_block` KV heads, one a warp (a cache's must be a multiple of it); `key` prefixes its
    row fields, `label` names its columns."""

    key: str
    kernel: str
    heads_a_block: int
    label: str


DECODE_VARIANTS = (
    DecodeVariant("heads", "warp_heads", 4, "one head a warp"),
    DecodeVariant("heads8", "warp_heads_8", 8, "eight heads a block"),
)


@dataclass
class SymbolicCache:
    """A one-layer cache whose head count and head size stay symbolic."""

    dtype: DType
    num_layers: int = NUM_LAYERS
    n_kv_heads_per_device: int | str = "n_kv_heads"
    head_dim: int | str = "head_dim"


def build_mokv_graph(dtype: DType, package: Path, device: DeviceRef | None = None) -> Graph:
    """mokv's attention (from the kernel `package`) over a one-layer paged
    cache on `device` (the CPU unless given), every size symbolic, so one
    compile per dtype serves every case."""
    cpu = DeviceRef.CPU()
    device = device or cpu
    inputs = [
        *mokv_graph.paged_input_types(SymbolicCache(dtype), device=device),
        TensorType(dtype, ["total_new_tokens", "n_q_heads", "head_dim"], device),
        TensorType(DType.uint32, ["batch_plus_one"], device),
        TensorType(DType.float32, [], cpu),
    ]
    name = f"bench_attention_{dtype.name}" + ("" if device == cpu else f"_{device.device_type}")
    with Graph(name, input_types=inputs, custom_extensions=[package]) as g:
        cache = mokv_graph.PagedCacheValues.from_inputs(g.inputs[:4])
        q, offsets, scale = (v.tensor for v in g.inputs[4:])
        g.output(mokv_graph.attention(cache, 0, q, offsets, scale))
    return g


class Kernels:
    """Compiled graphs on `device` (the CPU unless given), built on first use:
    mokv's per dtype (from the kernel `package`, by default this checkout's),
    MAX's per shape."""

    def __init__(self, session: InferenceSession, package: Path | None = None, device: Device | None = None) -> None:
        self.session = session
        self.package = package or kernel_package()
        self.device = device or CPU()
        self.mokv: dict[DType, Model] = {}
        self.max: dict[Any, Any] = {}  # MaxAttentionShape -> MaxPagedAttention

    def mokv_model(self, dtype: DType) -> Model:
        if dtype not in self.mokv:
            graph = build_mokv_graph(dtype, self.package, DeviceRef.from_device(self.device))
            self.mokv[dtype] = self.session.load(graph)
        return self.mokv[dtype]

    def max_kernel(self, case: Case) -> Any:
        """MAX's paged attention (`mokv_reference.max_attention.MaxPagedAttention`) compiled
        for the case's dtype, heads and page size."""
        max_attention = reference("max_attention", MAX_KERNELS)
        hq, hkv, d = case.heads
        shape = max_attention.MaxAttentionShape(case.dtype, NUM_LAYERS, hq, hkv, d, case.page_size, case.softmax_scale)
        if shape not in self.max:
            self.max[shape] = max_attention.MaxPagedAttention.compile(self.session, shape, self.device)
        return self.max[shape]

    def finished(self, call: Callable[[], Any]) -> Callable[[], Any]:
        """`call`, then a wait for the device (a no-op wait on the CPU, whose
        `execute` returns when the work is done)."""
        if self.device.is_host:
            return call

        def synchronized() -> Any:
            result = call()
            self.device.synchronize()
            return result

        return synchronized


def decode_variants(kernels: Kernels, heads: tuple[int, int, int], queries: DType) -> tuple[DecodeVariant, ...]:
    """The `DECODE_VARIANTS` a decode with these (query, KV, dim) heads and `queries` on the
    kernels' device takes: a GPU's tensor-core decode (bfloat16 queries, over a bfloat16 or
    8-bit cache; a float32 one ignores the variable), KV heads in whole blocks of each."""
    if kernels.device.is_host or queries != DType.bfloat16:
        return ()
    return tuple(v for v in DECODE_VARIANTS if heads[1] % v.heads_a_block == 0)
