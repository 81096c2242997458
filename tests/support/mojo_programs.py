"""Running a small Mojo program of the tests on the host, built against the
checkout's kernel sources: for code whose own results a Python test checks,
such as the GPU planner, the code conversions or the CPU fork-join.

Programs are built (`mojo build`) and the binary run, not JIT-run with
`mojo run`, which frees the program's code when `main` returns: a helper that
`parallel.run_items` left queued then jumps into freed code (`parallel.mojo`
says why helpers may outlive their call). Each build has a Mojo compile cache
of its own, as `emulation.build_harness`'s do: a build sharing the cache with
MAX graphs compiling in another process once failed in CI."""

from __future__ import annotations

import os
import signal
import subprocess
import tempfile
from pathlib import Path

from mokv.kernels import kernel_sources_root, mojo_compiler


def _run(command: list[str], **env: str) -> subprocess.CompletedProcess[str]:
    """`command`'s result, in this process's environment with `env` added."""
    return subprocess.run(
        command, capture_output=True, text=True, env=dict(os.environ, **env), timeout=600, check=False
    )


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
        build = [mojo_compiler(), "build", "-I", str(kernel_sources_root()), str(program), "-o", str(binary)]
        built = _run(build, MODULAR_CACHE_DIR=str(Path(folder) / "cache"))
        if built.returncode != 0:
            raise _failure(f"building {program.name}", built)
        result = _run([str(binary), *(str(a) for a in args)])
    if result.returncode != 0:
        raise _failure(program.name, result)
    return result.stdout
