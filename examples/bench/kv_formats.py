"""KV formats side by side, part of `mokv bench attention`: the same keys and
values stored as float32, bfloat16, float8_e4m3fn and int8 (one float32 scale
per token and KV head), then decoded over, on the CPU or (`--device gpu`) on a
GPU, where decode is memory-bound and the 8-bit formats' halved reads should
show as tokens/s (goal there: float8 >= 1.8x bfloat16 at 8k+ contexts).

Per case and format: the median seconds of a decode call (all formats timed
alternately, call by call), tokens/s, bytes per cached token (scales
included) and the KV read rate, tokens/s against bfloat16 and float32, the
largest difference from the float32 cache's output, and the cost of storing
the case's whole context (every sequence prefilled at once: quantizing on
store against a plain copy). The quantized caches are filled by mokv's own
store, so what is decoded is what a model would have stored. The 8-bit
caches take float32 keys, values and queries on the CPU (as SmolLM2's graph
runs) and bfloat16 on a GPU (as a model served there runs, so their decode
reaches the tensor cores as bfloat16's does). On a GPU one more case follows
Llama's: one KV head at the bytes of Llama's largest 8k batch (`layout_probe`),
whose rows lie back to back in each page as a head-major layout would hold every
head's: whether the cache's layout bounds the decode's KV read.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click
import numpy as np
from max.driver import CPU, Buffer, Device
from max.dtype import DType
from max.engine import Model
from max.graph import DeviceRef, Graph, TensorType

from mokv import KVCacheQuantConfig
from mokv import graph as mokv_graph
from mokv.graph import GraphGroup
from mokv_examples.bench.attention_cases import (
    LLAMA,
    ONE_KV_HEAD,
    SMOLLM2,
    bfloat16_exact,
    device_buffer,
    shape_fields,
    to_device,
    to_float,
)
from mokv_examples.bench.attention_kernels import (
    DECODE_KERNEL,
    DECODE_VARIANTS,
    DecodeVariant,
    Kernels,
    decode_variants,
)
from mokv_examples.bench.results import span
from mokv_examples.bench.timing import time_alternately, with_variable

FORMATS = ("float32", "bfloat16", "float8_e4m3fn", "int8")
CPU_REF = DeviceRef.CPU()
TARGETS = {"cpu": 1.6, "gpu": 1.8}
"""float8 decode tokens/s over bfloat16's that each device aims at."""


@dataclass(frozen=True)
class FormatCase:
    """`batch` sequences of `context` cached tokens, one new token each."""

    heads: tuple[int, int, int]
    page_size: int
    batch: int
    context: int

    @property
    def name(self) -> str:
        hq, hkv, d = self.heads
        return f"decode-{hq}x{hkv}x{d}-page{self.page_size}-b{self.batch}-ctx{self.context}"


def format_cases(quick: bool, gpu: bool = False) -> list[FormatCase]:
    """Memory-bound decode shapes: long contexts, SmolLM2's and Llama's heads
    (on a GPU longer contexts and larger batches, pages of 128)."""
    if gpu:
        shapes = ((1, 32768), (16, 8192)) if quick else ((1, 32768), (8, 8192), (32, 8192), (128, 1024))
        llama, smollm2 = (
            [FormatCase(heads, 128, batch, context) for batch, context in shapes] for heads in (LLAMA, SMOLLM2)
        )
        return [*llama, layout_probe(llama), *smollm2]
    if quick:
        return [FormatCase(SMOLLM2, 16, 16, 2048), FormatCase(LLAMA, 128, 4, 8192)]
    return [
        FormatCase(heads, page, batch, context)
        for heads in (SMOLLM2, LLAMA)
        for page in (16, 128)
        for batch, context in ((1, 8192), (4, 8192), (16, 2048))
    ]


def layout_probe(llama: Sequence[FormatCase]) -> FormatCase:
    """`ONE_KV_HEAD` at the bytes of the largest batch at 8k among `llama`: Llama's batch
    times its KV heads, so as many blocks read as many bytes, each head's rows back to back
    in a page rather than one row of each token."""
    case = max((c for c in llama if c.context == 8192), key=lambda c: c.batch)
    return FormatCase(ONE_KV_HEAD, case.page_size, case.batch * LLAMA[1], case.context)


def row_heads(row: dict[str, Any]) -> tuple[int, int, int]:
    """A formats row's (query, KV, dim) heads, as `FormatCase.heads` holds them."""
    return row["n_q_heads"], row["n_kv_heads"], row["head_dim"]


def is_layout_probe(row: dict[str, Any]) -> bool:
    """Whether a formats row is `layout_probe`'s, which no model runs: kept out of the targets."""
    return row_heads(row) == ONE_KV_HEAD


@dataclass
class FormatShape:
    """A one-layer cache of one format, heads and head size symbolic (one
    compiled graph per format serves every case)."""

    dtype: DType
    kvcache_quant_config: KVCacheQuantConfig | None
    rows: DType
    """The dtype of the keys, values and queries the cache takes."""
    num_layers: int = 1
    n_kv_heads_per_device: int | str = "n_kv_heads"
    head_dim: int | str = "head_dim"

    @classmethod
    def of(cls, kv_format: str, gpu: bool) -> FormatShape:
        """`kv_format`'s cache; its rows bfloat16 for a bfloat16 cache, and for
        an 8-bit one on a GPU, else float32."""
        quantized = kv_format in ("float8_e4m3fn", "int8")
        bfloat16_rows = kv_format == "bfloat16" or (quantized and gpu)
        rows = DType.bfloat16 if bfloat16_rows else DType.float32
        return cls(DType[kv_format], KVCacheQuantConfig() if quantized else None, rows)

    def bytes_per_token(self, heads: tuple[int, int, int]) -> int:
        """Keys and values of one token (one layer), scales included."""
        _, hkv, d = heads
        scales = 2 * hkv * 4 if self.kvcache_quant_config is not None else 0
        return 2 * hkv * d * self.dtype.size_in_bytes + scales


def _graphs(
    kv_format: str, shape: FormatShape, package: Path, device: DeviceRef, group: GraphGroup
) -> tuple[Graph, Graph]:
    """(store, decode) graphs over one format's cache on `device`, built into `group`."""
    cache_types = mokv_graph.paged_input_types(shape, device=device)
    n = len(cache_types.flatten())
    rows = TensorType(shape.rows, ["tokens", "n_kv_heads", "head_dim"], device)
    offsets = TensorType(DType.uint32, ["batch_plus_one"], device)
    where = "" if device == CPU_REF else f"_{device.device_type}"
    with group.graph(f"bench_store_{kv_format}{where}", [*cache_types, rows, rows, offsets], [package]) as store:
        cache = mokv_graph.PagedCacheValues.from_inputs(store.inputs[:n])
        keys, values, row_offsets = (v.tensor for v in store.inputs[n:])
        mokv_graph.store_kv(cache, 0, keys, values, row_offsets)
        store.output(row_offsets)
    q = TensorType(shape.rows, ["tokens", "n_q_heads", "head_dim"], device)
    scale = TensorType(DType.float32, [], CPU_REF)
    with group.graph(f"bench_decode_{kv_format}{where}", [*cache_types, q, offsets, scale], [package]) as decode:
        cache = mokv_graph.PagedCacheValues.from_inputs(decode.inputs[:n])
        queries, row_offsets, softmax_scale = (v.tensor for v in decode.inputs[n:])
        decode.output(mokv_graph.attention(cache, 0, queries, row_offsets, softmax_scale))
    return store, decode


class FormatKernels:
    """The store and decode graphs of each of `formats` on the attention kernels' device
    (`Kernels`: its session, kernel package and device), all compiled together on first
    use (`GraphGroup`: one compile where one per graph took most of a GPU run's formats
    step, 141 s of its 159 on an H200)."""

    def __init__(self, attention: Kernels, formats: Sequence[str] = FORMATS) -> None:
        self.attention = attention
        self.formats = tuple(formats)
        self.models: dict[str, tuple[Model, Model]] = {}

    def shape(self, kv_format: str) -> FormatShape:
        """`kv_format`'s cache on this device."""
        return FormatShape.of(kv_format, gpu=not self.attention.device.is_host)

    def __getitem__(self, kv_format: str) -> tuple[Model, Model]:
        if kv_format not in self.formats:
            raise KeyError(f"KV format {kv_format!r} is not among this bench's formats {self.formats}")
        if not self.models:
            where = DeviceRef.from_device(self.attention.device)
            group = GraphGroup()
            graphs = {f: _graphs(f, self.shape(f), self.attention.package, where, group) for f in self.formats}
            loaded = group.load(self.attention.session)
            self.models = {f: (loaded[store.name], loaded[decode.name]) for f, (store, decode) in graphs.items()}
        return self.models[kv_format]


def _cache_buffers(shape: FormatShape, case: FormatCase, device: Device) -> list[Buffer]:
    """A zeroed one-layer page tensor (as the graph takes it) and, quantized,
    its scales, on `device`."""
    _, hkv, d = case.heads
    pages = case.batch * -(-case.context // case.page_size) + 1
    values = Buffer.zeros([pages, 2, 1, case.page_size, hkv, d], shape.dtype)
    if shape.dtype == DType.float8_e4m3fn:
        values = values.view(DType.uint8)
    buffers = [values]
    if shape.kvcache_quant_config is not None:
        buffers.append(Buffer.zeros([pages, 2, 1, case.page_size, hkv, 1], DType.float32))
    CPU().synchronize()  # Buffer.zeros fills asynchronously (mokv.validation.allocate)
    return [to_device(b, device) for b in buffers]


@dataclass
class FormatCalls:
    """One format's calls on one case, each waiting for the device: a store of
    the whole context, and a decode of one new token per sequence."""

    store: Callable[[], Any]
    decode: Callable[[], Any]
    output: np.ndarray
    """The decode's output as float32, taken once the cache was filled."""


def format_calls(case: FormatCase, kernels: FormatKernels) -> dict[str, FormatCalls]:
    """Each of the kernels' formats: its cache filled with the same keys and values through
    its own store, and its calls (`tools/gpu_profile.py` profiles a format's decode)."""
    hq, hkv, d = case.heads
    rng = np.random.default_rng(0)
    pages_per_seq = -(-case.context // case.page_size)
    lookup = rng.permutation(case.batch * pages_per_seq).astype(np.uint32).reshape(case.batch, pages_per_seq)
    # bfloat16-exact values, so float32 and bfloat16 caches hold the same numbers.
    kv_shape = (case.batch * case.context, hkv, d)
    keys = bfloat16_exact(rng.standard_normal(kv_shape, np.float32))
    values = bfloat16_exact(rng.standard_normal(kv_shape, np.float32))
    q = bfloat16_exact(rng.standard_normal((case.batch, hq, d), np.float32))
    device, finished = kernels.attention.device, kernels.attention.finished

    def put(host: Buffer) -> Buffer:
        return to_device(host, device)

    prefill_offsets = put(Buffer.from_numpy((np.arange(case.batch + 1) * case.context).astype(np.uint32)))
    prefill_tables = [  # cache lengths and the page table on the device, the lengths' summary on the host
        put(Buffer.from_numpy(np.zeros(case.batch, np.uint32))),
        put(Buffer.from_numpy(lookup)),
        Buffer.from_numpy(np.array([[case.context, case.context]], np.uint32)),
    ]
    decode_tables = [
        put(Buffer.from_numpy(np.full(case.batch, case.context - 1, np.uint32))),
        put(Buffer.from_numpy(lookup)),
        Buffer.from_numpy(np.array([[1, case.context]], np.uint32)),
    ]
    decode_offsets = put(Buffer.from_numpy(np.arange(case.batch + 1, dtype=np.uint32)))
    softmax_scale = Buffer.from_numpy(np.array(1 / math.sqrt(d), np.float32))
    calls = {}
    for kv_format in kernels.formats:
        shape = kernels.shape(kv_format)
        store, decode = kernels[kv_format]
        pages, *scales = _cache_buffers(shape, case, device)
        store_args = [
            pages,
            *prefill_tables,
            *scales,
            device_buffer(keys, shape.rows, device),
            device_buffer(values, shape.rows, device),
            prefill_offsets,
        ]
        q_rows = device_buffer(q, shape.rows, device)
        decode_args = [pages, *decode_tables, *scales, q_rows, decode_offsets, softmax_scale]
        store_call = finished(lambda m=store, a=store_args: m.execute(*a))
        store_call()
        # A copy: the output buffer is reused by later calls (to_numpy copies it off a GPU).
        output = to_float(decode.execute(*decode_args)[0], shape.rows).copy()
        calls[kv_format] = FormatCalls(store_call, finished(lambda m=decode, a=decode_args: m.execute(*a)), output)
    return calls


def timed_variants(case: FormatCase, kernels: FormatKernels) -> tuple[tuple[DecodeVariant, ...], list[str]]:
    """The decode variants the case's heads take (`decode_variants`) and the formats whose
    decode each also times: those with bfloat16 queries, where bfloat16's is among them (the
    float8 goal's yardstick); none where it is not."""
    formats = [f for f in kernels.formats if kernels.shape(f).rows == DType.bfloat16]
    if "bfloat16" not in formats:
        return (), []
    return decode_variants(kernels.attention, case.heads, DType.bfloat16), formats


def run_format_case(case: FormatCase, kernels: FormatKernels, budget_s: float) -> list[dict[str, Any]]:
    """One case in every format (`format_calls`), stores and decodes timed
    alternately, and the decodes of `timed_variants` in the same rounds as
    each decode variant runs them."""
    prepared = format_calls(case, kernels)
    calls: dict[str, Callable[[], Any]] = {}
    for kv_format, format_call in prepared.items():
        calls[f"store-{kv_format}"] = format_call.store
        calls[kv_format] = format_call.decode
    variants, variant_formats = timed_variants(case, kernels)
    for v in variants:
        for kv_format in variant_formats:
            calls[f"{v.key}-{kv_format}"] = with_variable(DECODE_KERNEL, v.kernel, prepared[kv_format].decode)
    outputs = {kv_format: format_call.output for kv_format, format_call in prepared.items()}
    times = time_alternately(calls, min_runs=5, budget_s=budget_s)
    rows = []
    for kv_format in kernels.formats:
        shape = kernels.shape(kv_format)
        per_token = shape.bytes_per_token(case.heads)
        seconds = times[kv_format]
        rows.append(
            {
                "case": case.name,
                "kv_format": kv_format,
                "rows": shape.rows.name,
                **shape_fields(case.heads, case.page_size, case.batch, case.context),
                "bytes_per_token": per_token,
                "decode_s": seconds,
                "tokens_per_s": case.batch / seconds,
                "kv_gbps": case.batch * case.context * per_token / seconds / 1e9,
                "over_bfloat16": times["bfloat16"] / seconds,
                "over_float32": times["float32"] / seconds,
                "max_abs_diff_vs_float32": float(np.abs(outputs[kv_format] - outputs["float32"]).max()),
                "store_s": times[f"store-{kv_format}"],
                "store_over_float32": times[f"store-{kv_format}"] / times["store-float32"],
            }
        )
        for v in variants if kv_format in variant_formats else ():
            variant = times[f"{v.key}-{kv_format}"]
            decoded = with_variable(DECODE_KERNEL, v.kernel, prepared[kv_format].decode)()
            diff = to_float(decoded[0], shape.rows) - outputs["float32"]
            rows[-1] |= {
                f"{v.key}_decode_s": variant,
                f"{v.key}_kv_gbps": case.batch * case.context * per_token / variant / 1e9,
                f"{v.key}_over_default": seconds / variant,
                f"{v.key}_over_bfloat16": times[f"{v.key}-bfloat16"] / variant,
                f"{v.key}_max_abs_diff_vs_float32": float(np.abs(diff).max()),
            }
    return rows


def format_rows(attention_kernels: Kernels, quick: bool) -> list[dict[str, Any]]:
    """Every format case's rows, on the attention kernels' device."""
    kernels = FormatKernels(attention_kernels)
    started = time.perf_counter()
    rows = []
    for case in format_cases(quick, gpu=not attention_kernels.device.is_host):
        click.echo(f"{case.name}, KV formats ...", err=True)
        case_rows = run_format_case(case, kernels, budget_s=0.5 if quick else 1.5)
        click.echo(
            "  "
            + ", ".join(f"{r['kv_format']} {r['decode_s'] * 1e3:.3f} ms" for r in case_rows)
            + f"; {time.perf_counter() - started:.0f} s in",
            err=True,
        )
        rows += case_rows
    return rows


def formats_markdown(rows: list[dict[str, Any]], header: str, device: str = "cpu") -> str:
    """The formats' targets (float8 decode over bfloat16 as `TARGETS` says for
    the device, and >= 3x float32), then every row."""
    modelled = [r for r in rows if not is_layout_probe(r)]
    float8 = [r for r in modelled if r["kv_format"] == "float8_e4m3fn"]
    int8 = [r for r in modelled if r["kv_format"] == "int8"]
    target = TARGETS[device]
    lines = [
        header,
        "",
        f"- float8_e4m3fn decode tokens/s over bfloat16 (target >= {target}): "
        f"{span([r['over_bfloat16'] for r in float8])}",
        f"- float8_e4m3fn decode tokens/s over float32 (target >= 3): {span([r['over_float32'] for r in float8])}",
        f"- int8 decode tokens/s over bfloat16: {span([r['over_bfloat16'] for r in int8])}",
        "- storing a whole context, quantized over a float32 copy: "
        + ", ".join(
            f"{f} {span([r['store_over_float32'] for r in modelled if r['kv_format'] == f])}" for f in FORMATS[1:]
        ),
        *layout_probe_summary(rows),
        *(line for v in DECODE_VARIANTS for line in variant_summary(rows, v)),
        "",
        "| case | KV format | queries | bytes/token | decode ms | tokens/s | KV GB/s | vs bf16 | vs f32"
        " | max diff vs f32 | store ms | store vs f32 |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    lines += [
        f"| {r['case']} | {r['kv_format']} | {r['rows']} | {r['bytes_per_token']} | {r['decode_s'] * 1e3:.3f}"
        f" | {r['tokens_per_s']:.0f} | {r['kv_gbps']:.1f} | {r['over_bfloat16']:.2f}x | {r['over_float32']:.2f}x"
        f" | {r['max_abs_diff_vs_float32']:.1e} | {r['store_s'] * 1e3:.2f} | {r['store_over_float32']:.2f}x |"
        for r in rows
    ]
    return "\n".join(lines + [line for v in DECODE_VARIANTS for line in variant_table(rows, v)]) + "\n"


def layout_probe_summary(rows: list[dict[str, Any]]) -> list[str]:
    """`layout_probe`'s rows against Llama's at the same bytes: each format's KV read rate
    over Llama's (above 1, each token's heads side by side cost the decode that much), and
    float8's tokens/s over bfloat16's with each head's rows back to back."""
    probe = {r["kv_format"]: r for r in rows if is_layout_probe(r)}
    if not probe:
        return []
    first = next(iter(probe.values()))
    llama = {
        r["kv_format"]: r
        for r in rows
        if row_heads(r) == LLAMA and (r["batch"] * LLAMA[1], r["context"]) == (first["batch"], first["context"])
    }
    over_llama = ", ".join(
        f"{f} {probe[f]['kv_gbps'] / llama[f]['kv_gbps']:.2f}x" for f in FORMATS if f in probe and f in llama
    )
    float8 = probe.get("float8_e4m3fn")
    return [
        f"- one KV head ({first['case']}: its rows back to back in each page, as a head-major layout"
        f" holds every head's), KV read over Llama's heads at the same bytes: {over_llama or 'no Llama case'}"
        + (f"; float8_e4m3fn decode tokens/s over bfloat16 there: {float8['over_bfloat16']:.2f}" if float8 else "")
    ]


def variant_summary(rows: list[dict[str, Any]], variant: DecodeVariant) -> list[str]:
    """Where decodes were also timed as `variant` runs them: float8's tokens/s
    over bfloat16's with both so, and each format's over its own default
    decode."""
    timed = [r for r in rows if f"{variant.key}_decode_s" in r]
    if not timed:
        return []
    setting = f"MOKV_DECODE_KERNEL={variant.kernel}"
    return [
        f"- with {setting}, float8_e4m3fn decode tokens/s over bfloat16's: "
        f"{span([r[f'{variant.key}_over_bfloat16'] for r in timed if r['kv_format'] == 'float8_e4m3fn'])}",
        f"- {setting} over each format's default decode: "
        + ", ".join(
            f"{f} {span([r[f'{variant.key}_over_default'] for r in timed if r['kv_format'] == f])}"
            for f in FORMATS
            if any(r["kv_format"] == f for r in timed)
        ),
    ]


def variant_table(rows: list[dict[str, Any]], variant: DecodeVariant) -> list[str]:
    """The decodes also timed as `variant` runs them, in the same rounds."""
    timed = [r for r in rows if f"{variant.key}_decode_s" in r]
    if not timed:
        return []
    key = variant.key
    return [
        "",
        f"Decode with {variant.label} (`MOKV_DECODE_KERNEL={variant.kernel}`), timed in the same rounds:",
        "",
        f"| case | KV format | decode ms | KV GB/s | vs own default | vs bf16 {variant.label} | max diff vs f32 |",
        "|---|---|---:|---:|---:|---:|---:|",
        *(
            f"| {r['case']} | {r['kv_format']} | {r[f'{key}_decode_s'] * 1e3:.3f} | {r[f'{key}_kv_gbps']:.1f}"
            f" | {r[f'{key}_over_default']:.2f}x | {r[f'{key}_over_bfloat16']:.2f}x"
            f" | {r[f'{key}_max_abs_diff_vs_float32']:.1e} |"
            for r in timed
        ),
    ]
