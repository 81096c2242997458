"""`mokv bench attention`: mokv's paged flash attention against MAX 26.7's own.

Both kernels read the very same page tensor, lookup table and queries in the same process,
timed alternately call by call (the cores are shared, so only side-by-side ratios are
trustworthy), on the cases of `attention_cases`.

Each row reports the median seconds per `execute` of both kernels, KV bytes read per second by
each (one pass over every sequence's context: the figure of merit for decode, incidental for
compute-bound prefill), new tokens per second, the read rate of a plain 1 GiB `np.copyto`
measured next to the case as the machine's memory yardstick, and the largest difference
between the two kernels' outputs. bfloat16 decode rows also time mokv on the same values
stored as float32, in the same rounds, for the bfloat16/float32 tokens/s ratio. MAX's kernel
is compiled per (dtype, heads, head_dim, page size) before its cases are timed, so a full run
spends much of its time compiling. The KV formats are then timed side by side
(`kv_formats`): always on the CPU, with `--kv-formats` on a GPU.

`--device gpu` runs the same comparison on a GPU against MAX's built-in GPU kernel (flash
decoding for decode batches): longer contexts and larger batches, bfloat16 (and a few float32
rows). Every timed call ends with a device synchronize, so a row is the call's wall time,
launch overhead included for both kernels. The memory yardstick is then a 1 GiB
device-to-device copy: its traffic (read plus write) per second stands for the achievable HBM
bandwidth, against which the KV read rate of decode is set. On a Hopper GPU, whose bfloat16
prefill takes warpgroup products by default, the prefill rows also time mokv with
`MOKV_PREFILL_KERNEL=mma` (`mma.sync` per warp), `=wgmma_producer` (the warpgroup
products fed by a producer warpgroup) and `=wgmma_tma` (fed by tensor-map boxes) in the
same rounds (`PREFILL_VARIANTS`; `--prefill-variants` names fewer), its bfloat16 decode
rows also time the decodes `MOKV_DECODE_KERNEL` chooses over KV heads in whole blocks of
theirs (`DECODE_VARIANTS`: `=warp_heads`, a block of four KV heads, one a warp, `heads_*`
fields and the "one head a warp" columns; `=warp_heads_8`, eight, `heads8_*` and "eight
heads a block"), and every GPU row times
mokv with its context cut into a fixed number of splits (`MOKV_ATTENTION_SPLITS`,
`SPLIT_SWEEP`) beside the planner's choice, the data the planner is tuned from. Without a
GPU it says so and exits. `docs/gpu/results/` keeps the GPU runs' tables.
"""

from __future__ import annotations

import os
import platform
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click
import numpy as np
from max.driver import CPU, Accelerator, accelerator_architecture_name, accelerator_count
from max.dtype import DType
from max.engine import InferenceSession

from mokv_examples.bench.attention_cases import (
    Case,
    bfloat16_codec,
    full_cases,
    gpu_full_cases,
    gpu_quick_cases,
    make_inputs,
    quick_cases,
    shape_fields,
    to_float,
)
from mokv_examples.bench.attention_kernels import (
    DECODE_KERNEL,
    DECODE_VARIANTS,
    MAX_KERNELS,
    Kernels,
    decode_variants,
)
from mokv_examples.bench.kv_formats import format_rows, formats_markdown
from mokv_examples.bench.references import reference
from mokv_examples.bench.results import out_dir_option, span, write_results
from mokv_examples.bench.timing import CopyProbe, GpuCopyProbe, time_alternately, with_variable

PREFILL_KERNEL = "MOKV_PREFILL_KERNEL"
ATTENTION_SPLITS = "MOKV_ATTENTION_SPLITS"
SPLIT_SWEEP = (1, 2, 3, 4, 6, 8, 16, 32, 64, 128)
"""Split counts a GPU decode row is timed at beside the planner's (those
the context allows: one split per 256 tokens at most)."""
MIN_SPLIT_TOKENS = 256
"""Fewest context tokens of a split (`MIN_SPLIT_TOKENS` in
`mojo/mokv_kernels/gpu/attention/config.mojo`): larger counts run as this."""


@dataclass(frozen=True)
class PrefillVariant:
    """A prefill kernel a Hopper GPU's bfloat16 prefill rows also time,
    beside the default (`MOKV_PREFILL_KERNEL=kernel`), as the row's
    `{key}_s`, `{key}_speedup` and `{key}_max_abs_diff`."""

    key: str
    kernel: str
    label: str


PREFILL_VARIANTS = (
    PrefillVariant("mma", "mma", "mma.sync"),
    PrefillVariant("producer", "wgmma_producer", "producer-fed"),
    PrefillVariant("tma", "wgmma_tma", "TMA-fed"),
)
ALL_PREFILL_VARIANTS = ",".join(v.kernel for v in PREFILL_VARIANTS)
"""`--prefill-variants` unset: every variant."""
PREFILL_VARIANTS_VARIABLE = "MOKV_BENCH_PREFILL_VARIANTS"
"""Where `--prefill-variants` is also read from (and `tools/gpu_profile.py`'s list)."""


def chosen_variants(names: str) -> tuple[PrefillVariant, ...]:
    """The `PREFILL_VARIANTS` of a comma-separated list of their kernels
    (`--prefill-variants`); an unknown one is refused by name."""
    known = {v.kernel: v for v in PREFILL_VARIANTS}
    chosen = [name.strip() for name in names.split(",") if name.strip()]
    unknown = [name for name in chosen if name not in known]
    if unknown:
        raise click.BadParameter(
            f"{', '.join(unknown)}: expected some of {', '.join(known)}", param_hint="'--prefill-variants'"
        )
    return tuple(known[name] for name in chosen)


def has_warpgroup_mma(kernels: Kernels) -> bool:
    """Whether the benchmark's device is a Hopper GPU (sm_90)."""
    return not kernels.device.is_host and accelerator_architecture_name().startswith("sm_90")


def run_case(
    case: Case,
    kernels: Kernels,
    copy: CopyProbe | GpuCopyProbe,
    budget_s: float,
    prefill_variants: tuple[PrefillVariant, ...] = PREFILL_VARIANTS,
) -> dict[str, Any]:
    """Times one case. A bfloat16 decode case on the CPU also times mokv on
    the same values stored as float32, in the same rounds, for the tokens/s
    ratio; a bfloat16 prefill on a Hopper GPU also times mokv's prefill
    kernels of `prefill_variants` (warpgroup products are its default
    there), a bfloat16 decode on a GPU the `decode_variants` its KV heads
    take (`MOKV_DECODE_KERNEL`), and a GPU row mokv at
    each split count of `SPLIT_SWEEP` the context allows (`splits_s`)."""
    scale = case.softmax_scale
    with_f32 = case.dtype == DType.bfloat16 and case.phase == "decode" and kernels.device.is_host
    variants = prefill_variants
    if not (case.dtype == DType.bfloat16 and case.phase == "prefill" and has_warpgroup_mma(kernels)):
        variants = ()
    decodes = decode_variants(kernels, case.heads, case.dtype) if case.phase == "decode" else ()
    sweep = [n for n in SPLIT_SWEEP if n <= max(1, case.context // MIN_SPLIT_TOKENS)]
    if kernels.device.is_host:
        sweep = []
    dtypes = (case.dtype, DType.float32) if with_f32 else (case.dtype,)
    data = make_inputs(case, np.random.default_rng(0), dtypes, kernels.device)
    mine = data[case.dtype]
    mokv = kernels.mokv_model(case.dtype)
    mokv_args = mine.mokv_args(scale)
    max_kernel = kernels.max_kernel(case)
    max_args = max_kernel.inputs(mine.pages, mine.cache_lengths, mine.lookup_table, mine.row_offsets, mine.q, 0)
    calls: dict[str, Callable[[], Any]] = {
        "mokv": kernels.finished(lambda: mokv.execute(*mokv_args)),
        "max": kernels.finished(lambda: max_kernel(max_args)),
    }
    if with_f32:
        mokv_f32 = kernels.mokv_model(DType.float32)
        f32_args = data[DType.float32].mokv_args(scale)
        calls["mokv_float32"] = lambda: mokv_f32.execute(*f32_args)
    for v in variants:
        calls[f"mokv_{v.key}"] = with_variable(PREFILL_KERNEL, v.kernel, calls["mokv"])
    for d in decodes:
        calls[f"mokv_{d.key}"] = with_variable(DECODE_KERNEL, d.kernel, calls["mokv"])
    for n in sweep:
        calls[f"mokv_splits_{n}"] = with_variable(ATTENTION_SPLITS, str(n), calls["mokv"])

    expected = to_float(max_kernel(max_args), case.dtype)
    diff = np.abs(to_float(mokv.execute(*mokv_args)[0], case.dtype) - expected)
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
    for v in variants:
        out = with_variable(PREFILL_KERNEL, v.kernel, lambda: mokv.execute(*mokv_args)[0])()
        row[f"{v.key}_s"] = times[f"mokv_{v.key}"]
        row[f"{v.key}_speedup"] = times["max"] / times[f"mokv_{v.key}"]
        row[f"{v.key}_max_abs_diff"] = float(np.abs(to_float(out, case.dtype) - expected).max())
    for d in decodes:
        out = with_variable(DECODE_KERNEL, d.kernel, lambda: mokv.execute(*mokv_args)[0])()
        row[f"{d.key}_s"] = times[f"mokv_{d.key}"]
        row[f"{d.key}_speedup"] = times["max"] / times[f"mokv_{d.key}"]
        row[f"{d.key}_kv_gbps"] = case.kv_bytes / times[f"mokv_{d.key}"] / 1e9
        row[f"{d.key}_max_abs_diff"] = float(np.abs(to_float(out, case.dtype) - expected).max())
    if sweep:
        row["splits_s"] = {str(n): times[f"mokv_splits_{n}"] for n in sweep}
    return row


MEMORY_BOUND_BYTES = 1 << 28
"""A GPU decode case reading at least this much KV is memory-bound: the
launch overhead in its wall time is small."""


LONG_PREFILL = 2048
"""New tokens from which a GPU prefill is held to MAX's speed (issue 43: 2k-8k new tokens);
shorter chunks over a long cached context to 0.8x."""


def gpu_summary(rows: list[dict[str, Any]]) -> list[str]:
    """Issue 43's GPU targets: decode at least MAX's speed and its KV read at 85% of a device
    copy's traffic where memory-bound, prefill of 2k+ new tokens at least MAX's speed and of
    fewer (over a long cached context) 0.8x; then the variants timed beside the defaults."""
    decode = [r for r in rows if r["phase"] == "decode"]
    bound = [r for r in decode if r["kv_bytes"] >= MEMORY_BOUND_BYTES]
    prefill = [r for r in rows if r["phase"] == "prefill"]
    long_prefill = [r for r in prefill if r["new_tokens"] >= LONG_PREFILL]
    chunk_prefill = [r for r in prefill if r["new_tokens"] < LONG_PREFILL]
    return [
        f"- decode, speedup over MAX's GPU kernel (target >= 1): {span([r['speedup'] for r in decode])}",
        (
            "- decode reading >= 256 MiB of KV, KV read rate / device copy traffic (target >= 0.85):"
            f" {span([r['kv_gbps'] / r['copy_gbps'] for r in bound])}"
        ),
        (
            f"- prefill of {LONG_PREFILL}+ new tokens, speedup over MAX (target >= 1):"
            f" {span([r['speedup'] for r in long_prefill])}"
        ),
        (
            f"- prefill of fewer new tokens, speedup over MAX (target >= 0.8):"
            f" {span([r['speedup'] for r in chunk_prefill])}"
        ),
        *(
            f"- prefill with MOKV_PREFILL_KERNEL={v.kernel} (Hopper), speedup over MAX:"
            f" {span([r[f'{v.key}_speedup'] for r in prefill if f'{v.key}_speedup' in r])}"
            for v in PREFILL_VARIANTS
        ),
        *(
            f"- decode with MOKV_DECODE_KERNEL={d.kernel}, speedup over MAX:"
            f" {span([r[f'{d.key}_speedup'] for r in decode if f'{d.key}_s' in r])};"
            " KV read rate / device copy traffic where memory-bound:"
            f" {span([r[f'{d.key}_kv_gbps'] / r['copy_gbps'] for r in bound if f'{d.key}_s' in r])}"
            for d in DECODE_VARIANTS
            if any(f"{d.key}_s" in r for r in decode)
        ),
    ]


def summary(rows: list[dict[str, Any]]) -> list[str]:
    """One line per target: the range of each ratio over the cases it covers."""
    if rows and rows[0]["device"] == "gpu":
        return gpu_summary(rows)
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
    """The summary and the table; a prefill variant's columns, and a decode
    variant's, only where some row timed it beside the default (Hopper; a
    GPU)."""
    variants = [v for v in PREFILL_VARIANTS if any(f"{v.key}_s" in r for r in rows)]
    decodes = [d for d in DECODE_VARIANTS if any(f"{d.key}_s" in r for r in rows)]
    lines = [
        header,
        "",
        *summary(rows),
        "",
        "| case | mokv ms | MAX ms | speedup | mokv KV GB/s | MAX KV GB/s | copy GB/s | tokens/s | bf16/f32"
        " | max abs diff |"
        + "".join(f" {v.label} ms | {v.label} speedup | {v.label} max abs diff |" for v in variants)
        + "".join(f" {d.label} ms | speedup | KV GB/s | max abs diff |" for d in decodes),
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|" + "---:|" * (3 * len(variants) + 4 * len(decodes)),
    ]
    for r in rows:
        ratio = f"{r['bf16_over_f32']:.2f}x" if "bf16_over_f32" in r else ""
        timed = "".join(
            (
                f" {r[f'{v.key}_s'] * 1e3:.3f} | {r[f'{v.key}_speedup']:.2f}x | {r[f'{v.key}_max_abs_diff']:.1e} |"
                if f"{v.key}_s" in r
                else " | | |"
            )
            for v in variants
        )
        timed += "".join(
            (
                f" {r[f'{d.key}_s'] * 1e3:.3f} | {r[f'{d.key}_speedup']:.2f}x | {r[f'{d.key}_kv_gbps']:.1f}"
                f" | {r[f'{d.key}_max_abs_diff']:.1e} |"
                if f"{d.key}_s" in r
                else " | | | |"
            )
            for d in decodes
        )
        lines.append(
            f"| {r['case']} | {r['mokv_s'] * 1e3:.3f} | {r['max_s'] * 1e3:.3f} | {r['speedup']:.2f}x"
            f" | {r['kv_gbps']:.1f} | {r['max_kv_gbps']:.1f} | {r['copy_gbps']:.1f}"
            f" | {r['tokens_per_s']:.0f} | {ratio} | {r['max_abs_diff']:.1e} |{timed}"
        )
    return "\n".join(lines + split_sweep_table(rows)) + "\n"


def split_sweep_table(rows: list[dict[str, Any]]) -> list[str]:
    """The GPU rows' times at each fixed split count beside the planner's
    (`MOKV_ATTENTION_SPLITS`), as ratios of the planner's time: below 1 where
    a fixed count was faster. Empty where no row swept."""
    swept = [r for r in rows if "splits_s" in r]
    if not swept:
        return []
    counts = [str(n) for n in SPLIT_SWEEP]
    lines = [
        "",
        "Each context cut into a fixed number of splits (`MOKV_ATTENTION_SPLITS`), time over"
        " the planner's choice, timed in the same rounds:",
        "",
        "| case | planner ms | " + " | ".join(f"{n} splits" for n in counts) + " |",
        "|---|---:|" + "---:|" * len(counts),
    ]
    for r in swept:
        cells = [f"{r['splits_s'][n] / r['mokv_s']:.2f}" if n in r["splits_s"] else "" for n in counts]
        lines.append(f"| {r['case']} | {r['mokv_s'] * 1e3:.3f} | " + " | ".join(cells) + " |")
    return lines


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
    default=None,
    help="Also time mokv's decode and store over float32, bfloat16, float8_e4m3fn and int8 caches "
    "(attention[-gpu]-kv-formats.json/.md); default: on the CPU yes, on a GPU no (8 more graphs, compiled together).",
)
@click.option(
    "--only-kv-formats",
    is_flag=True,
    help="Time only the KV formats, none of the cases against MAX's kernel (a GPU run gives each its own time limit).",
)
@click.option(
    "--prefill-variants",
    default=ALL_PREFILL_VARIANTS,
    show_default=True,
    envvar=PREFILL_VARIANTS_VARIABLE,
    help="The MOKV_PREFILL_KERNEL values a Hopper GPU's bfloat16 prefill rows also time beside the default, "
    f"comma-separated (empty: none); also read from {PREFILL_VARIANTS_VARIABLE}.",
)
@out_dir_option("attention")
def attention(
    quick: bool, device: str, kv_formats: bool | None, only_kv_formats: bool, prefill_variants: str, out_dir: Path
) -> None:
    """Paged flash attention: mokv's kernel against MAX's built-in, decode and prefill; KV formats side by side."""
    if only_kv_formats and kv_formats is False:
        raise click.UsageError("--only-kv-formats and --no-kv-formats exclude each other")
    variants = chosen_variants(prefill_variants)
    reference("max_attention", MAX_KERNELS)  # before any compile: stop early where it is missing
    bfloat16_codec()
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
    started = time.perf_counter()
    rows = []
    for case in [] if only_kv_formats else cases:
        click.echo(f"{case.name} ...", err=True)
        row = run_case(case, kernels, copy, budget_s=0.5 if quick else 1.5, prefill_variants=variants)
        rows.append(row)
        click.echo(
            f"  mokv {row['mokv_s'] * 1e3:.3f} ms, MAX {row['max_s'] * 1e3:.3f} ms, {row['speedup']:.2f}x,"
            f" {row['kv_gbps']:.1f} GB/s (copy {row['copy_gbps']:.1f}); {time.perf_counter() - started:.0f} s in",
            err=True,
        )
    if rows:
        header = (
            f"## Paged attention, mokv vs MAX 26.7 ({where}{', quick' if quick else ''}):"
            f" median seconds per call, timed alternately; {yardstick}, measured next to each case"
        )
        markdown = to_markdown(rows, header)
        write_results(out_dir, "attention" if device == "cpu" else "attention-gpu", rows, markdown)
    if only_kv_formats or (kv_formats if kv_formats is not None else device == "cpu"):
        formats = format_rows(kernels, quick)
        header = (
            f"## KV formats, mokv decode and store ({where}{', quick' if quick else ''}):"
            " median seconds per call, all formats timed alternately"
        )
        name = "attention-kv-formats" if device == "cpu" else "attention-gpu-kv-formats"
        write_results(out_dir, name, formats, formats_markdown(formats, header, device))
