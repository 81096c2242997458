"""Running a small Mojo program of the tests on the host (`mojo run` against
the checkout's kernel sources): for code whose own results a Python test
checks, such as the GPU planner or the code conversions."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from mokv.kernels import kernel_sources_root, mojo_compiler


def run_program(program: Path, *args: object) -> str:
    """What `program` prints when run with `args`; fails the test with the
    compiler's or the program's message when it does not exit 0."""
    result = subprocess.run(
        [mojo_compiler(), "run", "-I", str(kernel_sources_root()), str(program), *(str(a) for a in args)],
        capture_output=True,
        text=True,
        env=dict(os.environ),
        timeout=600,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout
