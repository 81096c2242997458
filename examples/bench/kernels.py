"""`mokv bench kernels --against REV`: this checkout's attention kernels against
the same kernels as of a git revision, on the attention benchmark's cases.

Separate benchmark runs on a shared machine differ by more than most kernel changes are
worth. Here both builds run in one process, on the same inputs, calls alternating, so load
from other processes hits both alike and their ratio repeats closely. Each build is
precompiled into its own package (cached by source digest, so a rerun against the same
revision does not rebuild) and loaded into its own InferenceSession, since both register the
same op names. The largest difference between the two builds' outputs is reported too: a
refactor should leave it at 0.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import click
import numpy as np
from max.driver import CPU
from max.engine import InferenceSession

from mokv.kernels import kernel_package
from mokv_examples.bench.attention_cases import Case, bfloat16_codec, full_cases, make_inputs, quick_cases, to_float
from mokv_examples.bench.attention_kernels import Kernels
from mokv_examples.bench.results import out_dir_option, write_results
from mokv_examples.bench.revisions import kernel_sources_at
from mokv_examples.bench.timing import time_alternately


def compare_case(case: Case, ours: Kernels, theirs: Kernels, label: str, budget_s: float) -> dict[str, Any]:
    """Times one case with both builds alternating; `speedup` is theirs / ours."""
    data = make_inputs(case, np.random.default_rng(0), (case.dtype,))[case.dtype]
    args = data.mokv_args(case.softmax_scale)
    models = {"ours": ours.mokv_model(case.dtype), "theirs": theirs.mokv_model(case.dtype)}
    outputs = {name: to_float(model.execute(*args)[0], case.dtype) for name, model in models.items()}
    times = time_alternately(
        {name: (lambda model=model: model.execute(*args)) for name, model in models.items()},
        min_runs=5,
        budget_s=budget_s,
    )
    return {
        "case": case.name,
        "against": label,
        "mokv_s": times["ours"],
        "against_s": times["theirs"],
        "speedup": times["theirs"] / times["ours"],
        "kv_gbps": case.kv_bytes / times["ours"] / 1e9,
        "max_abs_diff": float(np.abs(outputs["ours"] - outputs["theirs"]).max()),
    }


def to_markdown(rows: list[dict[str, Any]], label: str) -> str:
    lines = [
        f"## mokv's attention kernels: this checkout against {label}, calls alternating in one process",
        "",
        "| case | this checkout ms | against ms | speedup | KV GB/s | max abs diff |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    lines.extend(
        f"| {r['case']} | {r['mokv_s'] * 1e3:.3f} | {r['against_s'] * 1e3:.3f} | {r['speedup']:.3f}x"
        f" | {r['kv_gbps']:.1f} | {r['max_abs_diff']:.1e} |"
        for r in rows
    )
    return "\n".join(lines) + "\n"


@click.command("kernels")
@click.option(
    "--against", "revision", required=True, help="Git revision whose kernels to compare with, e.g. HEAD or main~3."
)
@click.option("--quick", is_flag=True, help="The attention benchmark's quick subset.")
@click.option("--only", default="", help="Only cases whose name contains each of these comma-separated parts.")
@click.option("--seconds", default=3.0, show_default=True, help="Timing budget per case.")
@out_dir_option("kernels")
def kernels(revision: str, quick: bool, only: str, seconds: float, out_dir: Path) -> None:
    """This checkout's attention kernels against a git revision's, side by side."""
    bfloat16_codec()  # before any compile: stop early where the reference package is missing
    parts = [p for p in only.split(",") if p]
    cases = [c for c in (quick_cases() if quick else full_cases()) if all(p in c.name for p in parts)]
    if not cases:
        raise click.BadParameter(f"no benchmark case matches {only!r}", param_hint="--only")
    with tempfile.TemporaryDirectory() as tmp:
        their_package = kernel_package(kernel_sources_at(revision, Path(tmp)))
    ours = Kernels(InferenceSession(devices=[CPU()]))
    theirs = Kernels(InferenceSession(devices=[CPU()]), package=their_package)
    rows = []
    for case in cases:
        click.echo(f"{case.name} ...", err=True)
        row = compare_case(case, ours, theirs, revision, seconds)
        rows.append(row)
        click.echo(
            f"  {row['mokv_s'] * 1e3:.3f} ms against {row['against_s'] * 1e3:.3f} ms: {row['speedup']:.3f}x", err=True
        )
    write_results(out_dir, "kernels", rows, to_markdown(rows, revision))
