"""Running a small Mojo program of the tests on the host (`mojo run` against
the checkout's kernel sources): for code whose own results a Python test
checks, such as the GPU planner or the code conversions."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

from mokv.kernels import kernel_sources_root, mojo_compiler


def run_program(program: Path, *args: object) -> str:
    """What `program` prints when run with `args`; fails the test with its
    exit code and both streams' ends when it does not exit 0 (a crash of the
    program under `mojo run` and one of the compiler read alike otherwise)."""
    result = subprocess.run(
        [mojo_compiler(), "run", "-I", str(kernel_sources_root()), str(program), *(str(a) for a in args)],
        capture_output=True,
        text=True,
        env=dict(os.environ),
        timeout=600,
        check=False,
    )
    if result.returncode != 0:
        code = result.returncode
        ended = f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with {code}"
        raise AssertionError(
            f"{program.name} {ended}\nstdout: {result.stdout[-1500:]}\nstderr: {result.stderr[-3000:]}"
        )
    return result.stdout
