"""Running a small Mojo program of the tests on the host, built against the
checkout's kernel sources: for code whose own results a Python test checks,
such as the GPU planner, the code conversions or the CPU fork-join.

Programs are built (`mojo build`) and then run, not JIT-run with `mojo run`:
`mojo run` frees the program's code when `main` returns, while a helper that
`parallel.run_items` queued may not have started yet (the caller never waits
for its helpers to leave, by design), and such a helper then jumps into freed
code (`parallel_items.mojo` crashed that way once in about 200 loaded runs).
A built program keeps its code until the process ends, as a graph keeps its
kernels' code while it is loaded. Building also tells a compiler error from a
crash of the program."""

from __future__ import annotations

import os
import signal
import subprocess
import tempfile
from pathlib import Path

from mokv.kernels import kernel_sources_root, mojo_compiler


def _run(command: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(command, capture_output=True, text=True, env=dict(os.environ), timeout=600, check=False)


def _failure(what: str, result: subprocess.CompletedProcess[str]) -> AssertionError:
    code = result.returncode
    ended = f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with {code}"
    return AssertionError(f"{what} {ended}\nstdout: {result.stdout[-1500:]}\nstderr: {result.stderr[-3000:]}")


def run_program(program: Path, *args: object) -> str:
    """What `program` prints when built and run with `args`; fails the test
    with the exit code and both streams' ends when the build or the run does
    not exit 0."""
    with tempfile.TemporaryDirectory(prefix="mokv-program-") as folder:
        binary = Path(folder) / program.stem
        built = _run([mojo_compiler(), "build", "-I", str(kernel_sources_root()), str(program), "-o", str(binary)])
        if built.returncode != 0:
            raise _failure(f"building {program.name}", built)
        result = _run([str(binary), *(str(a) for a in args)])
    if result.returncode != 0:
        raise _failure(program.name, result)
    return result.stdout
