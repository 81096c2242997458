"""The GPU kernels widen 8-bit codes in words of several codes
(`mojo/mokv_kernels/gpu/codes.mojo`: float8 in pairs, int8 without an
integer-to-float conversion); every byte must give the very value the CPU
kernels' conversions give (`code_conversions.mojo`, run on the host)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from mokv.kernels import kernel_sources_root, mojo_compiler

PROGRAM = Path(__file__).with_name("code_conversions.mojo")


def test_every_code_widens_as_on_the_cpu():
    result = subprocess.run(
        [mojo_compiler(), "run", "-I", str(kernel_sources_root()), str(PROGRAM)],
        capture_output=True,
        text=True,
        env=dict(os.environ),
        timeout=600,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split("\n")[:2] == ["e4m3 ok", "int8 ok"], result.stdout
