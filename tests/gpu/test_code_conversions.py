"""The GPU kernels widen 8-bit codes in words of several codes
(`mojo/mokv_kernels/gpu/codes.mojo`: float8 in pairs to float16, scaled or
exactly, int8 to float32 or float16 without an integer-to-float
conversion); every byte must give the very value the CPU kernels'
conversions give (`code_conversions.mojo`, run on the host; on a GPU the
exact float8 conversion is one instruction, which the quantized GPU tests
read)."""

from __future__ import annotations

from pathlib import Path

from tests.support.mojo_programs import run_program

PROGRAM = Path(__file__).with_name("code_conversions.mojo")


def test_every_code_widens_as_on_the_cpu():
    output = run_program(PROGRAM)
    assert output.split("\n")[:4] == ["e4m3 ok", "int8 ok", "e4m3 float16 ok", "int8 float16 ok"], output
