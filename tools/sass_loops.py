"""The machine code of each NVIDIA kernel's tile loop: how many instructions
one pass of its largest loop issues per thread, and of which kinds, as ptxas
compiles the PTX of a `mojo build --target-accelerator sm_*` binary
(`tools/check_gpu_build.sh` builds one) and nvdisasm prints it.

This is the static half of a kernel's speed, readable without a GPU: the
eighth GPU run's profile (docs/gpu-runs.md) found the tensor-core prefill issuing
about 1,270 instructions per warp and tile, of which 128 were the products,
with two warps per scheduler to hide their latencies. A loop's body counts
each instruction once: an inner loop (a runtime loop the compiler did not
unroll) is its own row, run as many times as it iterates.

Kinds: `mma` (`HMMA`, `HGMMA`), `ldsm` (`LDSM`), `copy` (`LDGSTS`), `exp`
(`MUFU`), `float` (other F* arithmetic), `int` (integer arithmetic,
compares, selects, shifts, moves), `other` (branches, barriers, shared and
global loads and stores, conversions).

Needs ptxas and nvdisasm: `NVDISASM=path`, or on PATH (PyPI's
`nvidia-cuda-nvdisasm` wheel carries one under nvidia/cu13/bin).

With `--skips`, each kernel's tile loop (`tile_loop_first`: the loop with
the most products that holds no other such loop, else the largest) is
followed by the forward
branches inside it that skip 16 instructions or more, with what they skip
(the tensor-core loops' masking, taken only on tiles some row does not see
whole; their rescaling of the outputs, only when a row's max moves): a pass
that skips them issues that many fewer.

Usage: python3 tools/sass_loops.py [--skips] BINARY [SUBSTRING ...]
(kernels whose name, as `ptx_registers.py` prints it, contains a SUBSTRING;
default all)"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from ptx_registers import KERNEL, field, marker_label, modules

INSTRUCTION = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;", re.MULTILINE)
LABEL = re.compile(r"^\s*\.(L_x_\d+):", re.MULTILINE)
BRANCH = re.compile(r"\bBRA\s+(?:!?U?P\w+,\s*)?`\(\.(L_x_\d+)\)")
KINDS = {
    "mma": ("HMMA", "HGMMA"),
    "ldsm": ("LDSM",),
    "copy": ("LDGSTS",),
    "exp": ("MUFU",),
    "float": ("FMUL", "FADD", "FFMA", "FSEL", "FMNMX", "FSETP", "F2FP"),
    "int": ("IMAD", "IADD3", "ISETP", "LOP3", "SEL", "SHF", "LEA", "VIADD", "MOV", "PLOP3", "IABS", "IMNMX"),
}


@dataclass
class Loop:
    start: int
    end: int
    opcodes: list[str]
    skips: list[tuple[int, list[str]]]
    """Forward branches inside the loop: where, and the opcodes they skip."""

    def kinds(self) -> Counter[str]:
        counts: Counter[str] = Counter()
        for opcode in self.opcodes:
            kind = next((k for k, names in KINDS.items() if opcode in names), "other")
            counts[kind] += 1
        return counts


def opcode(text: str) -> str:
    """`@!P3 IMAD.WIDE.U32 R1, ...` -> `IMAD`."""
    return re.sub(r"^@!?U?P\w+\s+", "", text).split()[0].split(".")[0]


def loops(sass: str) -> list[Loop]:
    """Every loop: a branch back to a label, with the instructions between."""
    instructions = [(int(a, 16), text) for a, text in INSTRUCTION.findall(sass)]
    at: dict[str, int] = {}
    for label in LABEL.finditer(sass):
        following = INSTRUCTION.search(sass, label.end())
        if following:
            at[label.group(1)] = int(following.group(1), 16)
    forward = []
    for address, text in instructions:
        target = BRANCH.search(text)
        if target and text.startswith("@") and at.get(target.group(1), 0) > address:
            forward.append((address, [opcode(t) for a, t in instructions if address < a < at[target.group(1)]]))
    found = []
    for address, text in instructions:
        target = BRANCH.search(text)
        if target and at.get(target.group(1), address + 1) <= address:
            start = at[target.group(1)]
            body = [opcode(t) for a, t in instructions if start <= a <= address]
            skips = [(a, ops) for a, ops in forward if start <= a <= address and len(ops) >= 16]
            found.append(Loop(start, address, body, skips))
    # A branch back from a slow path placed after a loop (a shuffle's
    # `BRA.DIV` fallback returning into the loop's body) spans from inside
    # that loop to past its end: no loop of the program.
    return [lp for lp in found if not any(other.start < lp.start <= other.end < lp.end for other in found)]


def tile_loop_first(found: list[Loop]) -> list[Loop]:
    """The loops, the tile loop first: the one with the most products among
    those holding no other loop with products (a producer-fed kernel's
    barrier waits branch back around its whole consumer part, a loop that
    holds the tile loop and the first and last tiles' products), then by
    products and size."""

    def holds_products_loop(outer: Loop) -> bool:
        return any(
            inner is not outer and outer.start <= inner.start and inner.end <= outer.end and inner.kinds()["mma"]
            for inner in found
        )

    return sorted(found, key=lambda lp: (holds_products_loop(lp), -lp.kinds()["mma"], -len(lp.opcodes)))


def nvdisasm() -> str:
    return os.environ.get("NVDISASM", "nvdisasm")


def disassemble(cubin: Path) -> str:
    """nvdisasm's listing of the cubin at `cubin`."""
    return subprocess.run([nvdisasm(), "-c", str(cubin)], capture_output=True, text=True, check=True).stdout


def kernel_sass(ptx: str, ptxas: str = "ptxas") -> str:
    target = field(r"\.target (\S+)", ptx)
    with tempfile.TemporaryDirectory() as tmp:
        source, cubin = Path(tmp, "k.ptx"), Path(tmp, "k.cubin")
        source.write_text(ptx)
        subprocess.run([ptxas, f"-arch={target}", str(source), "-o", str(cubin)], check=True)
        return disassemble(cubin)


HEADER = f"{'kernel':30} {'loop':>13} {'instr':>6} " + " ".join(f"{k:>5}" for k in (*KINDS, "other"))
"""The column heads of `loop_rows`."""


def loop_rows(label: str, sass: str, show_skips: bool) -> list[str]:
    """A kernel's two largest loops, its tile loop first, a row each under
    `HEADER`; with `show_skips`, the tile loop's skips after them."""
    largest = tile_loop_first(loops(sass))[:2]
    rows = []
    for loop in largest:
        kinds = loop.kinds()
        cells = " ".join(f"{kinds[k]:>5}" for k in (*KINDS, "other"))
        rows.append(f"{label:30} {loop.start:>#6x}-{loop.end:<#6x} {len(loop.opcodes):>6} {cells}")
    for address, ops in largest[0].skips if show_skips and largest else []:
        kinds = Loop(0, 0, ops, []).kinds()
        what = ", ".join(f"{n} {k}" for k, n in kinds.most_common(3))
        rows.append(f"{'':30}   skips {len(ops):>4} at {address:#x}: {what}")
    return rows


def main(argv: list[str]) -> int:
    show_skips = argv[:1] == ["--skips"]
    binary, *wanted = argv[1:] if show_skips else argv
    print(HEADER)
    seen = set()
    for ptx in (m.decode() for m in modules(Path(binary).read_bytes())):
        marker = KERNEL.search(ptx)
        if marker is None:
            continue
        label = marker_label(marker)
        label += f" #{len([s for s in seen if s.startswith(label)])}"
        seen.add(label)
        if wanted and not any(w in label for w in wanted):
            continue
        for row in loop_rows(label, kernel_sass(ptx), show_skips):
            print(row)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
