"""`mokv bench kernels --against REV`: this checkout's attention kernels against
the same kernels as of a git revision, on the attention benchmark's cases.

Separate benchmark runs on a shared machine differ by 10-20%, more than most
kernel changes are worth. Here both builds run in one process, on the same
inputs, calls alternating, so load from other processes hits both alike and
the ratios repeat within about 1%. Each build is precompiled into its own
package (cached by source digest, so a rerun against the same revision does
not rebuild) and loaded into its own InferenceSession, since both register the
same op names. The largest difference between the two builds' outputs is
reported too: a refactor should leave it at 0.
"""

from __future__ import annotations

import math
import posixpath
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import click
import numpy as np
from max.driver import CPU
from max.engine import InferenceSession

from mokv.kernels import MOKV_KERNELS, kernel_package, kernel_source_dir
from mokv_examples.bench.attention import (
    Case,
    Kernels,
    full_cases,
    make_inputs,
    quick_cases,
    time_alternately,
    to_float,
)
from mokv_examples.bench.results import out_dir_option, write_results

GIT_LINK_MODE = "120000"
"""The mode `git ls-tree` gives a symbolic link."""


def _git(repo: Path, *args: str) -> bytes:
    result = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, check=False)
    if result.returncode != 0:
        raise click.ClickException(f"git {' '.join(args)}: {result.stderr.decode().strip()}")
    return result.stdout


def kernels_checkout(package: str = MOKV_KERNELS) -> tuple[Path, str]:
    """The git checkout the Mojo package `package` in use comes from, and its folder's path in it.

    Only a checkout (mokv installed editable, as `make setup` does) has revisions to
    compare; an installed wheel's kernels are not in one.
    """
    source = kernel_source_dir(package)
    try:
        repo = Path(_git(source, "rev-parse", "--show-toplevel").decode().strip())
    except click.ClickException as error:
        raise click.ClickException(
            f"bench kernels compares git revisions of a mokv checkout, but the kernels in use ({source}) "
            f"are not in one; install mokv editable from a checkout (make setup). {error.message}"
        ) from error
    return repo, source.relative_to(repo).as_posix()


def kernel_sources_at(revision: str, dest: Path, package: str = MOKV_KERNELS) -> Path:
    """Writes the sources of the Mojo package `package` as of git `revision` under `dest`
    and returns their folder (named like the package, as precompiling requires).

    A file the package links to in another package (`parallel.mojo`) is written as the file
    it points to at `revision`: git keeps a link as its target's path."""
    repo, folder = kernels_checkout(package)
    entries = _git(repo, "ls-tree", "-r", revision, "--", folder).decode().splitlines()
    if not entries:
        raise click.ClickException(f"{revision} has no kernel sources at {folder} in {repo}")
    for entry in entries:
        mode, _, rest = entry.partition(" ")
        name = rest.split("\t", 1)[1]
        content = _git(repo, "show", f"{revision}:{name}")
        if mode == GIT_LINK_MODE:
            target = posixpath.normpath(posixpath.join(posixpath.dirname(name), content.decode()))
            content = _git(repo, "show", f"{revision}:{target}")
        path = dest / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content)
    return dest / folder


def compare_case(case: Case, ours: Kernels, theirs: Kernels, label: str, budget_s: float) -> dict[str, Any]:
    """Times one case with both builds alternating; `speedup` is theirs / ours."""
    data = make_inputs(case, np.random.default_rng(0), (case.dtype,))[case.dtype]
    args = data.mokv_args(1 / math.sqrt(case.heads[2]))
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
