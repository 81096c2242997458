"""The tile loops of MAX's own attention kernels as compiled for an NVIDIA
GPU, read as `sass_loops.py` reads mokv's: the reference's instructions per
tile beside ours, without a GPU.

MAX keeps the kernels a graph compiles in its cache (`MODULAR_CACHE_DIR`),
each kernel module with its cubins. `tools/compile_gpu_graphs.py bench`
compiles the quick benchmark's graphs for sm_90a, MAX's
`flash_attention_ragged` among them, and `tools/gpu_warm_cache.sh` packs that
cache (`.gpu-warm/modular.tar.gz`). This takes every cubin out of a cache
directory or such an archive, keeps the kernels whose name holds a SUBSTRING
(default `mha`), each once, and prints per kernel its threads a block and
registers (its `.nv.info`), the register counts its warpgroups ask with
`setmaxnreg`, and its tile loop's instructions by kind with the forward
branches inside it that skip 16 or more (`sass_loops.py --skips`).

Needs nvdisasm (`NVDISASM=path`, as `sass_loops.py`).

Usage: python3 tools/max_kernel_loops.py CACHE [SUBSTRING ...]"""

from __future__ import annotations

import re
import struct
import sys
import tarfile
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from sass_loops import HEADER, disassemble, loop_rows

ELF = b"\x7fELF"
EM_CUDA = 190
"""`e_machine` of an NVIDIA cubin."""
SHT_NOBITS = 8
"""A section that takes no bytes of the file."""
EIATTR_MAX_THREADS = 0x05
EIATTR_REGCOUNT = 0x2F
EIFMT_SVAL = 0x04
"""An `.nv.info` attribute with a sized value (the others hold none or two bytes)."""
SETMAXNREG = re.compile(r"USETMAXREG\.(TRY_ALLOC|DEALLOC)\S*\s+(?:U?P\w+,\s*)?(0x[0-9a-f]+)")


@dataclass(frozen=True)
class Cubin:
    """One kernel's cubin and what its `.nv.info` says of it."""

    name: str
    threads: int | None
    """Its most threads a block, where its `.nv.info` declares them."""
    registers: int
    data: bytes


@dataclass(frozen=True)
class Section:
    """One section header of an ELF: its name's offset in the names
    section, its type, and where its bytes lie from the ELF's start."""

    name: int
    kind: int
    offset: int
    size: int


def section_headers(blob: bytes, at: int = 0) -> list[Section]:
    """The section headers of the 64-bit ELF starting at `at`."""
    sections_at = struct.unpack_from("<Q", blob, at + 0x28)[0]
    section_size, section_count = struct.unpack_from("<HH", blob, at + 0x3A)
    headers = []
    for i in range(section_count):
        header = at + sections_at + i * section_size
        name, kind = struct.unpack_from("<II", blob, header)
        offset, size = struct.unpack_from("<QQ", blob, header + 0x18)
        headers.append(Section(name, kind, offset, size))
    return headers


def elf_end(blob: bytes, at: int) -> int:
    """Where the 64-bit ELF starting at `at` ends: past its last section or
    header table."""
    program_at, sections_at = struct.unpack_from("<QQ", blob, at + 0x20)
    program_size, program_count, section_size, section_count = struct.unpack_from("<HHHH", blob, at + 0x36)
    end = max(sections_at + section_size * section_count, program_at + program_size * program_count)
    for section in section_headers(blob, at):
        if section.kind != SHT_NOBITS:
            end = max(end, section.offset + section.size)
    return at + end


def sections(cubin: bytes) -> dict[str, bytes]:
    """A cubin's sections by name."""
    names_index = struct.unpack_from("<H", cubin, 0x3E)[0]
    headers = section_headers(cubin)
    names_at = headers[names_index].offset
    found = {}
    for section in headers:
        start = names_at + section.name
        label = cubin[start : cubin.index(b"\0", start)].decode()
        found[label] = cubin[section.offset : section.offset + section.size]
    return found


def attributes(info: bytes) -> Iterator[tuple[int, bytes]]:
    """An `.nv.info` section's (attribute, value) pairs."""
    at = 0
    while at + 4 <= len(info):
        form, attribute, size = struct.unpack_from("<BBH", info, at)
        if form == EIFMT_SVAL:
            yield attribute, info[at + 4 : at + 4 + size]
            at += 4 + size
        else:
            yield attribute, info[at + 2 : at + 4]
            at += 4


def described(cubin: bytes) -> Cubin | None:
    """The kernel of a one-kernel cubin, with its threads and registers."""
    found = sections(cubin)
    names = [label.removeprefix(".text.") for label in found if label.startswith(".text.")]
    if len(names) != 1:
        return None
    threads = None
    registers = 0
    for attribute, value in attributes(found.get(".nv.info." + names[0], b"")):
        if attribute == EIATTR_MAX_THREADS:
            x, y, z = struct.unpack("<III", value)
            threads = x * y * z
    for attribute, value in attributes(found.get(".nv.info", b"")):
        if attribute == EIATTR_REGCOUNT:
            registers = struct.unpack("<II", value)[1]
    return Cubin(names[0], threads, registers, cubin)


def cubins(blob: bytes) -> Iterator[bytes]:
    """The NVIDIA cubins inside a file's bytes."""
    at = blob.find(ELF)
    while at >= 0:
        if blob[at + 4] == 2 and struct.unpack_from("<H", blob, at + 18)[0] == EM_CUDA:
            yield blob[at : elf_end(blob, at)]
        at = blob.find(ELF, at + 4)


def cache_files(cache: Path) -> Iterator[bytes]:
    """The files of a cache directory or of a `.tar.gz` of one."""
    if cache.is_dir():
        yield from (path.read_bytes() for path in sorted(cache.rglob("*")) if path.is_file())
        return
    with tarfile.open(cache) as archive:
        for member in archive:
            if member.isfile():
                yield archive.extractfile(member).read()


def listing(cubin: bytes) -> str:
    """nvdisasm's listing of a cubin."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as file:
        file.write(cubin)
        file.flush()
        return disassemble(Path(file.name))


def summary(kernel: Cubin, sass: str) -> str:
    """A kernel's name, threads, registers and `setmaxnreg` requests."""
    threads = "threads not declared" if kernel.threads is None else f"{kernel.threads} threads"
    asks = ", ".join(f"{kind.lower()} {int(count, 16)}" for kind, count in SETMAXNREG.findall(sass))
    return f"{kernel.name}: {threads}, {kernel.registers} registers" + (f", setmaxnreg {asks}" if asks else "")


def main(argv: list[str]) -> int:
    cache, *wanted = argv
    wanted = wanted or ["mha"]
    seen: set[bytes] = set()
    kernels = []
    for blob in cache_files(Path(cache)):
        for cubin in cubins(blob):
            kernel = described(cubin)
            if kernel and kernel.data not in seen and any(w in kernel.name for w in wanted):
                seen.add(kernel.data)
                kernels.append(kernel)
    if not kernels:
        print(f"no kernel named with {' or '.join(wanted)} in {cache}", file=sys.stderr)
        return 1
    listed = [(kernel, listing(kernel.data)) for kernel in sorted(kernels, key=lambda k: k.name)]
    for i, (kernel, sass) in enumerate(listed):
        print(f"#{i} {summary(kernel, sass)}")
    print(HEADER)
    for i, (kernel, sass) in enumerate(listed):
        for row in loop_rows(f"#{i} {kernel.name[:26]}", sass, show_skips=True):
            print(row)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
