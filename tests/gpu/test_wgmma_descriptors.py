"""The `wgmma` prefills build the descriptors of their key and value slices
as the tile's descriptor advanced by each slice's start
(`SharedOperand.advanced_descriptor`, `mojo/mokv_kernels/gpu/warpgroup.mojo`),
where MAX's `WGMMADescriptor.create` masks each slice's address anew. The
emulator reads operands through the PTX ISA's layouts, not through
descriptors, so only a GPU would show a wrong bit: this checks, on the host,
that both give the same 64 bits for every slice over every tile address
shared memory holds (`wgmma_descriptors.mojo`)."""

from __future__ import annotations

from pathlib import Path

from tests.support.mojo_programs import run_program

PROGRAM = Path(__file__).with_name("wgmma_descriptors.mojo")


def test_advanced_descriptors_are_those_made_from_each_slice_address():
    output = run_program(PROGRAM)
    expected = ["keys 64 ok", "keys 128 ok", "K-major 128 from row 64 ok", "values 64 ok", "values 128 ok"]
    assert output.strip().split("\n") == expected, output
