"""Whether two builds of the GPU kernels compile to the same machine code, kernel by
kernel: how a change that should not touch a kernel (a move, a new variant beside
it, a comment) is shown not to, without a GPU.

Each build is a `mojo build --target-accelerator sm_*` binary of
`tools/gpu_build_check.mojo` (`tools/check_gpu_build.sh` builds one). Its kernels are
matched by their `// mokv-kernel` marker (name, head_dim, bits, threads, shared
memory, ...): kernels with one marker are paired by their code where they can be (the
order an op instantiates them in may change), the rest in order. Each is compiled by
ptxas and listed by nvdisasm, and two listings are the same when their instructions
are, addresses and the symbol names Mojo mangles from a package's path aside. Prints
the kernels that differ, each with how (the same instructions on other registers or in
another order, which is ptxas scheduling and allocating otherwise, or the opcodes one
build has more of), those only in one build, and a count; exits 1 where a kernel of
both builds differs.

Needs ptxas and nvdisasm (`NVDISASM=path`, as `tools/sass_loops.py`).

Usage: python3 tools/sass_same.py BEFORE AFTER"""

from __future__ import annotations

import re
import sys
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from ptx_registers import KERNEL, marker_label, modules
from sass_loops import INSTRUCTION, kernel_sass, opcode

MANGLED = re.compile(r"\bmokv_kernels\w*")
"""A symbol Mojo names after the kernel package (its path and a hash enter it)."""
NAMED = re.compile(r"\bU?[RPB]\d+\b|\.L_x_\d+")
"""Names ptxas picks freely: numbered registers (general, predicate, barrier, uniform)
and branch labels."""


def instructions(listing: str) -> list[str]:
    """A listing's instructions, in order, without addresses or mangled names."""
    return [MANGLED.sub("K", text) for _, text in INSTRUCTION.findall(listing)]


def kernels(ptx_modules: Iterable[str]) -> dict[tuple[str, int], str]:
    """Each kernel's PTX by (marker, n): the n-th kernel with that marker."""
    found: dict[tuple[str, int], str] = {}
    for ptx in ptx_modules:
        marker = KERNEL.search(ptx)
        if marker is None:
            continue
        n = sum(1 for key in found if key[0] == marker.group(0))
        found[(marker.group(0), n)] = ptx
    return found


def free_choices_aside(instruction: str) -> str:
    """An instruction with what ptxas picks freely blanked: its names (`NAMED`) and
    operand-reuse flags."""
    return NAMED.sub("_", instruction.replace(".reuse", ""))


def how_they_differ(before: list[str], after: list[str]) -> str:
    """How two listings of one kernel differ: only in what ptxas picks freely (registers,
    order), or in the opcodes one has more of than the other."""
    if Counter(map(free_choices_aside, before)) == Counter(map(free_choices_aside, after)):
        return f"the same {len(before)} instructions, registers and order aside"
    opcodes_before, opcodes_after = Counter(map(opcode, before)), Counter(map(opcode, after))
    more = ", ".join(f"{name} +{n}" for name, n in sorted((opcodes_after - opcodes_before).items()))
    fewer = ", ".join(f"{name} -{n}" for name, n in sorted((opcodes_before - opcodes_after).items()))
    changes = "; ".join(part for part in (more, fewer) if part) or "the same opcodes, other operands"
    return f"{len(before)} -> {len(after)} instructions: {changes}"


@dataclass
class Difference:
    before: tuple[str, int]
    after: tuple[str, int]
    how: str
    """`how_they_differ`."""


@dataclass
class Comparison:
    differ: list[Difference]
    only_before: list[tuple[str, int]]
    only_after: list[tuple[str, int]]
    same: int


def compare(
    before: dict[tuple[str, int], str], after: dict[tuple[str, int], str], listing: Callable[[str], str]
) -> Comparison:
    """The kernels of both builds whose `listing`s' instructions differ, and those of one. Kernels
    with one marker are paired by their code first (an op may instantiate the same kernels in
    another order: float8's and int8's, say, share a marker), then the rest in order."""
    code_before = {key: instructions(listing(ptx)) for key, ptx in before.items()}
    code_after = {key: instructions(listing(ptx)) for key, ptx in after.items()}
    result = Comparison([], [], [], 0)
    for marker in dict.fromkeys(key[0] for key in [*before, *after]):
        unpaired_before = [key for key in before if key[0] == marker]
        unpaired_after = [key for key in after if key[0] == marker]
        for key in list(unpaired_before):
            twin = next((other for other in unpaired_after if code_after[other] == code_before[key]), None)
            if twin is not None:
                unpaired_before.remove(key)
                unpaired_after.remove(twin)
                result.same += 1
        paired = min(len(unpaired_before), len(unpaired_after))
        result.differ += [
            Difference(old, new, how_they_differ(code_before[old], code_after[new]))
            for old, new in zip(unpaired_before[:paired], unpaired_after[:paired], strict=True)
        ]
        result.only_before += unpaired_before[paired:]
        result.only_after += unpaired_after[paired:]
    return result


def label(key: tuple[str, int]) -> str:
    marker, n = key
    fields = KERNEL.match(marker)
    assert fields is not None
    return f"{marker_label(fields)} #{n}"


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    before, after = (kernels(m.decode() for m in modules(Path(path).read_bytes())) for path in argv)
    result = compare(before, after, kernel_sass)
    for difference in result.differ:
        print(f"differs: {label(difference.before)}: {difference.how}")
    for key in result.only_before:
        print(f"only before: {label(key)}")
    for key in result.only_after:
        print(f"only after: {label(key)}")
    print(
        f"{result.same} kernels the same, {len(result.differ)} differ, {len(result.only_before)} only before,"
        f" {len(result.only_after)} only after"
    )
    return 1 if result.differ else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
