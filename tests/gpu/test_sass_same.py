"""`tools/sass_same.py` matches two builds' kernels by their markers and compares
their machine code less addresses and package-mangled names: the docs' "the same
machine code, instruction for instruction" rests on it."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))

import sass_same

MARKER = "// mokv-kernel {} head_dim=128 bits=16 threads=128 shared=1024 min_blocks=3 tensor_cores=1"


def ptx(name: str, body: str) -> str:
    return MARKER.format(name) + "\n" + body


def listing(*instructions: str, package: str = "mokv_kernels_gpu_block_closurA1") -> str:
    """nvdisasm's lines for `instructions`, a call naming a symbol of `package`."""
    lines = [f"        /*{16 * i:04x}*/                   {text} ;" for i, text in enumerate(instructions)]
    lines.append(f"        /*{16 * len(instructions):04x}*/                   CALL.REL `({package}) ;")
    return "\n".join(lines)


def test_kernels_match_by_marker_and_order():
    found = sass_same.kernels([ptx("decode_mma", "a"), "no marker", ptx("decode_mma", "b"), ptx("prefill_mma", "c")])
    assert [(key[0].split()[2], key[1], body[-1]) for key, body in found.items()] == [
        ("decode_mma", 0, "a"),
        ("decode_mma", 1, "b"),
        ("prefill_mma", 0, "c"),
    ]


def test_same_code_at_other_addresses_and_package_paths_is_the_same():
    before = sass_same.kernels([ptx("decode_mma", "old"), ptx("merge", "old-merge")])
    after = sass_same.kernels([ptx("decode_mma", "new"), ptx("merge", "new-merge"), ptx("decode_mma_heads", "x")])
    listings = {
        "old": listing("HMMA.16816.F32.BF16 R20, R92, R96, RZ", "FADD R1, R2, R3"),
        "new": "        /*0000*/  NOP ;\n"
        + listing("HMMA.16816.F32.BF16 R20, R92, R96, RZ", "FADD R1, R2, R3", package="mokv_kernels_other_B2")[1:],
        "old-merge": listing("FMUL R1, R2, R3"),
        "new-merge": listing("FMUL R1, R2, R4"),
        "x": listing("NOP"),
    }
    result = sass_same.compare(before, after, lambda code: listings[code.splitlines()[-1]])
    # "new" adds a NOP: it differs; the merge reads another register: it differs too.
    assert [d.before[0].split()[2] for d in result.differ] == ["decode_mma", "merge"]
    assert [d.how for d in result.differ] == [
        "3 -> 4 instructions: NOP +1",
        "the same 2 instructions, registers and order aside",
    ]
    assert [key[0].split()[2] for key in result.only_after] == ["decode_mma_heads"]
    listings["new"] = listing("HMMA.16816.F32.BF16 R20, R92, R96, RZ", "FADD R1, R2, R3", package="mokv_kernels_x_C3")
    listings["new-merge"] = listings["old-merge"]
    result = sass_same.compare(before, after, lambda code: listings[code.splitlines()[-1]])
    assert (result.differ, result.only_before, result.same) == ([], [], 2)


def test_kernels_of_one_marker_built_in_another_order_are_the_same():
    """An op that instantiates two kernels of one marker (float8's and int8's) the other way round."""
    before = sass_same.kernels([ptx("decode", "a"), ptx("decode", "b"), ptx("decode", "c")])
    after = sass_same.kernels([ptx("decode", "b"), ptx("decode", "a"), ptx("decode", "d")])
    listings = {name: listing(f"FADD R1, R2, R{i}") for i, name in enumerate("abcd")}
    result = sass_same.compare(before, after, lambda code: listings[code.splitlines()[-1]])
    assert result.same == 2
    assert [(d.before[1], d.after[1]) for d in result.differ] == [(2, 2)]


def test_a_difference_says_whether_only_registers_and_order_changed():
    before = ["@P0 IMAD R4, R2, R3, RZ", "LDC.64 R30, c[0x0][0x380]", "@!P1 BRA `(.L_x_7)", "FADD R1, R30.reuse, R2"]
    reordered = ["LDC.64 R24, c[0x0][0x380]", "@P2 IMAD R6, R2, R3, RZ", "FADD R1, R24, R2", "@!P3 BRA `(.L_x_9)"]
    assert sass_same.how_they_differ(before, reordered) == "the same 4 instructions, registers and order aside"
    # A constant, an opcode and a guard are not ptxas's free choices.
    other_constant = [*reordered[:1], "@P2 IMAD R6, R2, R3, 0x4", *reordered[2:]]
    assert sass_same.how_they_differ(before, other_constant) == "4 -> 4 instructions: the same opcodes, other operands"
    assert sass_same.how_they_differ(before, [*before[:3], "FMUL R1, R30, R2", "FMUL R5, R6, R7"]) == (
        "4 -> 5 instructions: FMUL +2; FADD -1"
    )
