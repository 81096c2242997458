"""`mokv bench attention`: mokv's paged flash attention against MAX 26.7's own.

Both kernels read the very same block tensor, lookup table and queries in the
same process, timed alternately call by call (the cores are shared, so only
side-by-side ratios are trustworthy). Shapes follow FlashInfer's decode
benchmark scaled to a 2-core CPU: Llama-style 32 query / 8 KV heads of 128 and
SmolLM2's 9 / 3 heads of 64, pages of 16 and 128 tokens, batch 1..64 at contexts
of 512..8192; plus prefill chunks of 128..2048 tokens on a cached prefix.

Each row reports the median seconds per `execute` of both kernels, KV bytes
read per second by each (one pass over every sequence's context: the figure of
merit for decode, incidental for compute-bound prefill), new tokens per
second, the read rate of a plain 1 GiB `np.copyto` measured next to the case as
the machine's memory yardstick, and the largest difference between the two
kernels' outputs. bfloat16 decode rows also time mokv on the same values
stored as float32, in the same rounds, for the bfloat16/float32 tokens/s ratio.
MAX's kernel is compiled per (dtype, heads, head_dim, page size): a full run
compiles 8 of its graphs (~1.5-3 minutes each on 2 cores) before timing.

`--device gpu` runs the same comparison on a GPU against MAX's built-in GPU
kernel (flash decoding for decode batches): decode at batch 1..128 and
context 1k..32k, prefill chunks of 512..8k tokens, bfloat16 (and a few
float32 rows). Every timed call ends with a device synchronize, so a row is
the call's wall time, launch overhead included for both kernels. The memory
yardstick is then a 1 GiB device-to-device copy: its traffic (read plus
write) per second stands for the achievable HBM bandwidth, against which the
KV read rate of decode is set. Without a GPU it says so and exits.
`docs/gpu/results/` keeps the GPU runs' tables.
"""

from __future__ import annotations

import math
import os
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click
import numpy as np
from max.driver import CPU, Accelerator, Buffer, Device, accelerator_architecture_name, accelerator_count
from max.dtype import DType
from max.engine import InferenceSession, Model
from max.graph import DeviceRef, Graph, TensorType

from mokv import graph as mokv_graph
from mokv.kernels import kernel_package
from mokv_examples.bench.results import out_dir_option, write_results
from mokv_reference import bfloat16
from mokv_reference.max_attention import MaxAttentionShape, MaxPagedAttention

NUM_LAYERS = 1
LLAMA = (32, 8, 128)  # query heads, KV heads, head_dim
SMOLLM2 = (9, 3, 64)


@dataclass(frozen=True)
class Case:
    """One timed configuration: `batch` sequences of `context` tokens each,
    the last `new_tokens` of which are this step's queries."""

    phase: str  # "decode" or "prefill"
    dtype: DType
    heads: tuple[int, int, int]
    page_size: int
    batch: int
    context: int
    new_tokens: int = 1

    @property
    def name(self) -> str:
        hq, hkv, d = self.heads
        shape = f"b{self.batch}-ctx{self.context}" + (f"-new{self.new_tokens}" if self.phase == "prefill" else "")
        return f"{self.phase}-{self.dtype.name}-{hq}x{hkv}x{d}-page{self.page_size}-{shape}"

    def max_shape(self) -> MaxAttentionShape:
        hq, hkv, d = self.heads
        return MaxAttentionShape(self.dtype, NUM_LAYERS, hq, hkv, d, self.page_size, 1 / math.sqrt(d))

    @property
    def kv_bytes(self) -> int:
        """K and V bytes one call must read: every sequence's whole context."""
        _, hkv, d = self.heads
        return self.batch * self.context * 2 * hkv * d * self.dtype.size_in_bytes


def full_cases() -> list[Case]:
    decode_shapes = [(1, 512), (1, 8192), (4, 8192), (16, 512), (16, 2048), (64, 512), (64, 2048)]
    cases = [
        Case("decode", dtype, heads, page, batch, context)
        for dtype in (DType.float32, DType.bfloat16)
        for heads in (LLAMA, SMOLLM2)
        for page in (16, 128)
        for batch, context in decode_shapes
    ]
    # (cached prefix, chunk); the 16-token chunk (a speculative-decoding
    # verify step) makes few, long work items that only split-K spreads out.
    prefill_shapes = [(0, 2048), (2048, 512), (4096, 128), (4096, 16)]
    cases += [
        Case("prefill", DType.float32, heads, 128, 1, cached + chunk, chunk)
        for heads in (LLAMA, SMOLLM2)
        for cached, chunk in prefill_shapes
    ]
    # MAX's bfloat16 kernel takes ~50 us per (query token, context token) pair
    # with Llama's 32 heads on this machine (about 15 s per call for a 128-token
    # chunk, an hour for a 2048-token prompt), so bfloat16 prefill gets one chunk.
    cases += [Case("prefill", DType.bfloat16, heads, 128, 1, 2048 + 128, 128) for heads in (LLAMA, SMOLLM2)]
    return cases


def quick_cases() -> list[Case]:
    """One MAX graph per dtype (Llama heads, page 128): MAX's compile dominates."""
    return [
        Case("decode", DType.float32, LLAMA, 128, 16, 2048),
        Case("decode", DType.bfloat16, LLAMA, 128, 16, 2048),
        Case("decode", DType.float32, LLAMA, 128, 1, 8192),
        Case("prefill", DType.float32, LLAMA, 128, 1, 2048 + 512, 512),
    ]


GPU_KV_TOKEN_LIMIT = 1 << 20
"""Most context tokens in one decode case (4 GiB of bfloat16 Llama KV, which
the host builds as float32 first)."""


def gpu_full_cases() -> list[Case]:
    decode = [
        Case("decode", DType.bfloat16, heads, 128, batch, context)
        for heads in (LLAMA, SMOLLM2)
        for batch in (1, 8, 32, 128)
        for context in (1024, 8192, 32768)
        if batch * context <= GPU_KV_TOKEN_LIMIT
    ]
    decode += [Case("decode", DType.bfloat16, LLAMA, 16, batch, 4096) for batch in (1, 32)]
    decode += [Case("decode", DType.float32, LLAMA, 128, batch, 8192) for batch in (1, 32)]
    # (cached prefix, chunk)
    prefill = [(0, 512), (0, 2048), (0, 8192), (8192, 512), (8192, 2048), (24576, 8192)]
    return decode + [Case("prefill", DType.bfloat16, LLAMA, 128, 1, cached + chunk, chunk) for cached, chunk in prefill]


def gpu_quick_cases() -> list[Case]:
    """Llama heads in bfloat16, page 128: one MAX graph."""
    return [
        Case("decode", DType.bfloat16, LLAMA, 128, 1, 32768),
        Case("decode", DType.bfloat16, LLAMA, 128, 32, 4096),
        Case("decode", DType.bfloat16, LLAMA, 128, 128, 1024),
        Case("prefill", DType.bfloat16, LLAMA, 128, 1, 2048, 2048),
        Case("prefill", DType.bfloat16, LLAMA, 128, 1, 8192 + 512, 512),
    ]


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


def _fill(shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """Random-looking N(0, 1) float32 data of any size, fast: one random block
    tiled, rounded to values bfloat16 holds exactly so both dtypes see the same
    numbers."""
    size = math.prod(shape)
    pattern = bfloat16.from_bits(bfloat16.to_bits(rng.standard_normal(min(size, 1 << 20), dtype=np.float32)))
    return np.resize(pattern, size).reshape(shape)


def _buffer(values: np.ndarray, dtype: DType, device: Device) -> Buffer:
    if dtype == DType.bfloat16:
        host = Buffer.from_numpy(bfloat16.to_bits(values)).view(DType.bfloat16)
    else:
        host = Buffer.from_numpy(values)
    return host if device.is_host else host.to(device)


def to_float(out: Buffer, dtype: DType) -> np.ndarray:
    """A kernel's output as numpy floats (bfloat16 as exact float32 values)."""
    if dtype == DType.bfloat16:
        return bfloat16.from_bits(out.view(DType.uint16).to_numpy())
    return out.to_numpy()


@dataclass
class Inputs:
    """One case's data in one storage dtype, shared by both kernels; `blocks`
    and `q` on `device`."""

    blocks: Buffer
    q: Buffer
    cache_lengths: np.ndarray
    lookup_table: np.ndarray
    row_offsets: np.ndarray
    max_lengths: np.ndarray
    device: Device

    def mokv_args(self, scale: float) -> list[Buffer]:
        """mokv's graph inputs: the paged cache (its `max_lengths` summary on
        the host, the rest on the device), then q, offsets and scale."""

        def on_device(array: np.ndarray) -> Buffer:
            host = Buffer.from_numpy(array)
            return host if self.device.is_host else host.to(self.device)

        return [
            self.blocks,
            on_device(self.cache_lengths),
            on_device(self.lookup_table),
            Buffer.from_numpy(self.max_lengths),
            self.q,
            on_device(self.row_offsets),
            Buffer.from_numpy(np.array(scale, np.float32)),
        ]


def make_inputs(
    case: Case, rng: np.random.Generator, dtypes: tuple[DType, ...], device: Device | None = None
) -> dict[DType, Inputs]:
    """The case's cache and queries in each of `dtypes` (same values), on
    `device` (the CPU unless given). Every sequence's pages are drawn at
    random from a shared pool (MAX's null page last), so consecutive pages of
    a sequence are not adjacent in memory."""
    device = device or CPU()
    hq, hkv, d = case.heads
    pages_per_seq = -(-case.context // case.page_size)
    num_pages = case.batch * pages_per_seq
    lookup = rng.permutation(num_pages).astype(np.uint32).reshape(case.batch, pages_per_seq)
    blocks = _fill((num_pages + 1, 2, NUM_LAYERS, case.page_size, hkv, d), rng)
    q = _fill((case.batch * case.new_tokens, hq, d), rng)
    cache_lengths = np.full(case.batch, case.context - case.new_tokens, np.uint32)
    row_offsets = (np.arange(case.batch + 1) * case.new_tokens).astype(np.uint32)
    max_lengths = np.array([[case.new_tokens, case.context]], np.uint32)
    return {
        dtype: Inputs(
            _buffer(blocks, dtype, device),
            _buffer(q, dtype, device),
            cache_lengths,
            lookup,
            row_offsets,
            max_lengths,
            device,
        )
        for dtype in dtypes
    }


def time_alternately(calls: dict[str, Callable[[], Any]], min_runs: int, budget_s: float) -> dict[str, float]:
    """Median seconds per call of each callable, run in turn (so load from
    other processes hits all of them alike) after one warm-up each, at least
    `min_runs` rounds (3 when one round alone outlasts `budget_s`: MAX's
    bfloat16 kernel takes seconds per call) and until `budget_s` is spent, at
    most 50 rounds."""
    start = time.perf_counter()
    for call in calls.values():
        call()
    if time.perf_counter() - start > budget_s:
        min_runs = min(min_runs, 3)
    times: dict[str, list[float]] = {name: [] for name in calls}
    start = time.perf_counter()
    rounds = 0
    while rounds < min_runs or (time.perf_counter() - start < budget_s and rounds < 50):
        for name, call in calls.items():
            t0 = time.perf_counter()
            call()
            times[name].append(time.perf_counter() - t0)
        rounds += 1
    return {name: statistics.median(t) for name, t in times.items()}


class CopyProbe:
    """The memory yardstick: `np.copyto` between two 1 GiB float32 arrays,
    kept for the whole run and re-measured next to every case."""

    def __init__(self) -> None:
        self.src = np.ones(1 << 28, np.float32)
        self.dst = np.empty_like(self.src)
        np.copyto(self.dst, self.src)

    def gbps(self, runs: int = 3) -> float:
        """Bytes read per second (median of `runs` copies), in GB/s."""
        times = []
        for _ in range(runs):
            t0 = time.perf_counter()
            np.copyto(self.dst, self.src)
            times.append(time.perf_counter() - t0)
        return self.src.nbytes / statistics.median(times) / 1e9


class GpuCopyProbe:
    """The GPU's memory yardstick: a 1 GiB device-to-device copy, whose read
    plus write traffic per second stands for the achievable HBM bandwidth."""

    def __init__(self, device: Device) -> None:
        self.device = device
        self.src = Buffer(DType.uint8, [1 << 30], device=device)
        self.dst = Buffer(DType.uint8, [1 << 30], device=device)
        self.dst.inplace_copy_from(self.src)
        device.synchronize()

    def gbps(self, runs: int = 5) -> float:
        """Bytes moved (read + written) per second, median of `runs`, in GB/s."""
        times = []
        for _ in range(runs):
            t0 = time.perf_counter()
            self.dst.inplace_copy_from(self.src)
            self.device.synchronize()
            times.append(time.perf_counter() - t0)
        return 2 * self.src.num_elements / statistics.median(times) / 1e9


class Kernels:
    """Compiled graphs on `device` (the CPU unless given), built on first use:
    mokv's per dtype (from the kernel `package`, by default this checkout's),
    MAX's per shape."""

    def __init__(self, session: InferenceSession, package: Path | None = None, device: Device | None = None) -> None:
        self.session = session
        self.package = package or kernel_package()
        self.device = device or CPU()
        self.mokv: dict[DType, Model] = {}
        self.max: dict[MaxAttentionShape, MaxPagedAttention] = {}

    def mokv_model(self, dtype: DType) -> Model:
        if dtype not in self.mokv:
            graph = build_mokv_graph(dtype, self.package, DeviceRef.from_device(self.device))
            self.mokv[dtype] = self.session.load(graph)
        return self.mokv[dtype]

    def max_kernel(self, shape: MaxAttentionShape) -> MaxPagedAttention:
        if shape not in self.max:
            self.max[shape] = MaxPagedAttention.compile(self.session, shape, self.device)
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


def shape_fields(heads: tuple[int, int, int], page_size: int, batch: int, context: int) -> dict[str, int]:
    """A case's shape as JSON row fields."""
    hq, hkv, d = heads
    return {
        "n_q_heads": hq,
        "n_kv_heads": hkv,
        "head_dim": d,
        "page_size": page_size,
        "batch": batch,
        "context": context,
    }


def run_case(case: Case, kernels: Kernels, copy: CopyProbe | GpuCopyProbe, budget_s: float) -> dict[str, Any]:
    """Times one case. A bfloat16 decode case on the CPU also times mokv on
    the same values stored as float32, in the same rounds, for the tokens/s
    ratio."""
    d = case.heads[2]
    scale = 1 / math.sqrt(d)
    with_f32 = case.dtype == DType.bfloat16 and case.phase == "decode" and kernels.device.is_host
    dtypes = (case.dtype, DType.float32) if with_f32 else (case.dtype,)
    data = make_inputs(case, np.random.default_rng(0), dtypes, kernels.device)
    mine = data[case.dtype]
    mokv = kernels.mokv_model(case.dtype)
    mokv_args = mine.mokv_args(scale)
    max_kernel = kernels.max_kernel(case.max_shape())
    max_args = max_kernel.inputs(mine.blocks, mine.cache_lengths, mine.lookup_table, mine.row_offsets, mine.q, 0)
    calls: dict[str, Callable[[], Any]] = {
        "mokv": kernels.finished(lambda: mokv.execute(*mokv_args)),
        "max": kernels.finished(lambda: max_kernel(max_args)),
    }
    if with_f32:
        mokv_f32 = kernels.mokv_model(DType.float32)
        f32_args = data[DType.float32].mokv_args(scale)
        calls["mokv_float32"] = lambda: mokv_f32.execute(*f32_args)

    diff = np.abs(to_float(mokv.execute(*mokv_args)[0], case.dtype) - to_float(max_kernel(max_args), case.dtype))
    copy_rate = copy.gbps()
    times = time_alternately(calls, min_runs=5, budget_s=budget_s)
    row = {
        "device": "cpu" if kernels.device.is_host else "gpu",
        "case": case.name,
        "phase": case.phase,
        "dtype": case.dtype.name,
        **shape_fields(case.heads, case.page_size, case.batch, case.context),
        "new_tokens": case.new_tokens,
        "kv_bytes": case.kv_bytes,
        "mokv_s": times["mokv"],
        "max_s": times["max"],
        "speedup": times["max"] / times["mokv"],
        "kv_gbps": case.kv_bytes / times["mokv"] / 1e9,
        "max_kv_gbps": case.kv_bytes / times["max"] / 1e9,
        "copy_gbps": copy_rate,
        "tokens_per_s": case.batch * case.new_tokens / times["mokv"],
        "max_abs_diff": float(diff.max()),
    }
    if with_f32:
        row["mokv_float32_s"] = times["mokv_float32"]
        row["bf16_over_f32"] = times["mokv_float32"] / times["mokv"]
    return row


def _span(values: list[float]) -> str:
    """min, median and max of a ratio over the cases it covers."""
    if not values:
        return "no cases"
    cases = f"{len(values)} case" + ("s" if len(values) > 1 else "")
    return f"min {min(values):.2f}, median {statistics.median(values):.2f}, max {max(values):.2f} ({cases})"


MEMORY_BOUND_BYTES = 1 << 28
"""A GPU decode case reading at least this much KV is memory-bound: the
launch overhead in its wall time is small."""


def gpu_summary(rows: list[dict[str, Any]]) -> list[str]:
    """The GPU targets: decode at least MAX's speed and 80% of the HBM
    bandwidth where memory-bound, prefill at least 0.8x MAX's."""
    decode = [r for r in rows if r["phase"] == "decode"]
    bound = [r for r in decode if r["kv_bytes"] >= MEMORY_BOUND_BYTES]
    prefill = [r for r in rows if r["phase"] == "prefill"]
    return [
        f"- decode, speedup over MAX's GPU kernel (target >= 1): {_span([r['speedup'] for r in decode])}",
        (
            "- decode reading >= 256 MiB of KV, KV read rate / device copy traffic (target >= 0.8):"
            f" {_span([r['kv_gbps'] / r['copy_gbps'] for r in bound])}"
        ),
        f"- prefill, speedup over MAX (target >= 0.8): {_span([r['speedup'] for r in prefill])}",
    ]


def summary(rows: list[dict[str, Any]]) -> list[str]:
    """One line per target: the range of each ratio over the cases it covers."""
    if rows and rows[0]["device"] == "gpu":
        return gpu_summary(rows)
    span = _span
    long_decode = [r for r in rows if r["phase"] == "decode" and r["context"] >= 2048]
    return [
        f"- decode at 2k+ context, speedup over MAX (target >= 3): {span([r['speedup'] for r in long_decode])}",
        (
            "- decode at 2k+ context, KV read rate / np.copyto read rate (target >= 1):"
            f" {span([r['kv_gbps'] / r['copy_gbps'] for r in long_decode])}"
        ),
        (
            "- decode, bfloat16 tokens/s over float32 tokens/s, same values, timed side by side (target >= 1.6):"
            f" {span([r['bf16_over_f32'] for r in rows if 'bf16_over_f32' in r])}"
        ),
        f"- prefill, speedup over MAX (target >= 1.5): {span([r['speedup'] for r in rows if r['phase'] == 'prefill'])}",
    ]


def to_markdown(rows: list[dict[str, Any]], header: str) -> str:
    lines = [
        header,
        "",
        *summary(rows),
        "",
        "| case | mokv ms | MAX ms | speedup | mokv KV GB/s | MAX KV GB/s | copy GB/s | tokens/s | bf16/f32"
        " | max abs diff |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        ratio = f"{r['bf16_over_f32']:.2f}x" if "bf16_over_f32" in r else ""
        lines.append(
            f"| {r['case']} | {r['mokv_s'] * 1e3:.3f} | {r['max_s'] * 1e3:.3f} | {r['speedup']:.2f}x"
            f" | {r['kv_gbps']:.1f} | {r['max_kv_gbps']:.1f} | {r['copy_gbps']:.1f}"
            f" | {r['tokens_per_s']:.0f} | {ratio} | {r['max_abs_diff']:.1e} |"
        )
    return "\n".join(lines) + "\n"


@click.command("attention")
@click.option("--quick", is_flag=True, help="A representative subset (under five minutes, MAX's compiles included).")
@click.option(
    "--device",
    type=click.Choice(["cpu", "gpu"]),
    default="cpu",
    show_default=True,
    help="Where both kernels run; gpu writes attention-gpu.json/.md and exits with a message when there is no GPU.",
)
@click.option(
    "--kv-formats/--no-kv-formats",
    default=True,
    show_default=True,
    help="On the CPU, also time decode and store over float32, bfloat16, float8_e4m3fn and int8 caches "
    "(attention-kv-formats.json/.md).",
)
@out_dir_option("attention")
def attention(quick: bool, device: str, kv_formats: bool, out_dir: Path) -> None:
    """Paged flash attention: mokv's kernel against MAX's built-in, decode and prefill; KV formats side by side."""
    copy: CopyProbe | GpuCopyProbe
    if device == "gpu":
        if accelerator_count() == 0:
            click.echo(
                "mokv bench attention --device gpu: skipped, MAX sees no GPU on this machine; nothing was timed",
                err=True,
            )
            return
        gpu = Accelerator()
        cases = gpu_quick_cases() if quick else gpu_full_cases()
        kernels = Kernels(InferenceSession(devices=[CPU(), gpu]), device=gpu)
        copy = GpuCopyProbe(gpu)
        where = f"GPU {accelerator_architecture_name()}"
        yardstick = "copy = traffic (read + write) of a 1 GiB device-to-device copy"
    else:
        cases = quick_cases() if quick else full_cases()
        kernels = Kernels(InferenceSession(devices=[CPU()]))
        copy = CopyProbe()
        where = f"{platform.machine()}, {os.cpu_count()} cores"
        yardstick = "copy = np.copyto of 1 GiB"
    rows = []
    for case in cases:
        click.echo(f"{case.name} ...", err=True)
        row = run_case(case, kernels, copy, budget_s=0.5 if quick else 1.5)
        rows.append(row)
        click.echo(
            f"  mokv {row['mokv_s'] * 1e3:.3f} ms, MAX {row['max_s'] * 1e3:.3f} ms, {row['speedup']:.2f}x,"
            f" {row['kv_gbps']:.1f} GB/s (copy {row['copy_gbps']:.1f})",
            err=True,
        )
    header = (
        f"## Paged attention, mokv vs MAX 26.7 ({where}{', quick' if quick else ''}):"
        f" median seconds per call, timed alternately; {yardstick}, measured next to each case"
    )
    markdown = to_markdown(rows, header)
    write_results(out_dir, "attention" if device == "cpu" else "attention-gpu", rows, markdown)
    if device == "cpu" and kv_formats:
        from mokv_examples.bench.kv_formats import format_rows, formats_markdown  # it builds on this module

        formats = format_rows(kernels.session, kernels.package, quick)
        header = (
            f"## KV formats, mokv decode and store ({where}{', quick' if quick else ''}):"
            " median seconds per call, all formats timed alternately"
        )
        write_results(out_dir, "attention-kv-formats", formats, formats_markdown(formats, header))
