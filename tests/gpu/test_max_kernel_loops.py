"""`tools/max_kernel_loops.py` finds MAX's compiled kernels inside its cache's
files, which hold cubins among other bytes, and reads each one's threads and
registers from its `.nv.info`: a cubin cut short or a misread attribute would
put another kernel's or no figures beside mokv's in the docs."""

from __future__ import annotations

import io
import struct
import sys
import tarfile
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))

import max_kernel_loops


def info(attribute: int, value: bytes) -> bytes:
    """One sized `.nv.info` attribute."""
    return struct.pack("<BBH", max_kernel_loops.EIFMT_SVAL, attribute, len(value)) + value


SHARED_BYTES = 0x24000
"""A kernel's `.nv.shared` section: its size, no bytes of the file."""


def cubin(name: str, threads: tuple[int, int, int] | None, registers: int, bodies_last: bool = False) -> bytes:
    """A cubin of one kernel: as ptxas lays one out (the ELF header, the
    sections' bytes, their headers, one program header), or with the
    sections' bytes last, after both header tables; with a shared-memory
    section that takes no bytes of the file (`SHT_NOBITS`, placed at the
    end of the bytes with a size past it), and the threads declared unless
    `threads` is None."""
    declared = b"" if threads is None else info(max_kernel_loops.EIATTR_MAX_THREADS, struct.pack("<III", *threads))
    bodies = {
        f".text.{name}": b"\x00" * 32,
        ".nv.info": struct.pack("<BBH", 1, 0x36, 0)
        + info(max_kernel_loops.EIATTR_REGCOUNT, struct.pack("<II", 3, registers)),
        f".nv.info.{name}": struct.pack("<BBH", 1, 0x0A, 0) + declared,
        ".shstrtab": b"",
    }
    labels = [*bodies, f".nv.shared.{name}"]
    names = b"\0" + b"".join(label.encode() + b"\0" for label in labels)
    bodies[".shstrtab"] = names
    count = len(labels) + 1
    tables = count * 64 + 56
    data_at = 64 + tables if bodies_last else 64
    sections_at = 64 if bodies_last else 64 + sum(len(b) for b in bodies.values())
    headers = [b"\0" * 64]
    offset = data_at
    for label, body in bodies.items():
        name_at = names.index(label.encode() + b"\0")
        headers.append(struct.pack("<IIQQQQIIQQ", name_at, 1, 0, 0, offset, len(body), 0, 0, 1, 0))
        offset += len(body)
    shared_name = names.index(f".nv.shared.{name}".encode() + b"\0")
    headers.append(
        struct.pack("<IIQQQQIIQQ", shared_name, max_kernel_loops.SHT_NOBITS, 0, 0, offset, SHARED_BYTES, 0, 0, 16, 0)
    )
    program = struct.pack("<IIQQQQQQ", 6, 4, sections_at + count * 64, 0, 0, 56, 56, 8)
    header = bytearray(64)
    header[:5] = b"\x7fELF\x02"
    struct.pack_into("<H", header, 18, max_kernel_loops.EM_CUDA)
    struct.pack_into("<QQ", header, 0x20, sections_at + count * 64, sections_at)
    struct.pack_into("<HHHHH", header, 0x36, 56, 1, 64, count, len(bodies))
    data = b"".join(bodies.values())
    tables_bytes = b"".join(headers) + program
    return bytes(header) + (tables_bytes + data if bodies_last else data + tables_bytes)


@pytest.mark.parametrize("bodies_last", [False, True], ids=["headers last", "sections last"])
def test_a_cubin_among_other_bytes_is_cut_whole_and_read(bodies_last):
    kernel = cubin("sm90_mha_depth128", (384, 1, 1), 168, bodies_last)
    host = b"\x7fELF\x02\x01" + b"\x00" * 12 + struct.pack("<H", 62)  # an x86-64 header: not a cubin
    found = list(max_kernel_loops.cubins(host + b"padding" + kernel + b"\x00" * 40 + kernel))
    assert found == [kernel, kernel]
    described = max_kernel_loops.described(found[0])
    assert (described.name, described.threads, described.registers) == ("sm90_mha_depth128", 384, 168)


def test_a_kernel_without_declared_threads_says_so():
    """A kernel launched without a maximum block size has no such
    attribute: its summary must not print a count of 0 threads."""
    kernel = max_kernel_loops.described(cubin("mha_splitk_reduce", None, 32))
    assert kernel.threads is None
    sass = (
        "        /*08e0*/   USETMAXREG.TRY_ALLOC.CTAPOOL UP0, 0xe0 ;\n"
        "        /*2ce0*/   USETMAXREG.DEALLOC.CTAPOOL 0x38 ;"
    )
    assert max_kernel_loops.summary(kernel, sass) == (
        "mha_splitk_reduce: threads not declared, 32 registers, setmaxnreg try_alloc 224, dealloc 56"
    )
    declared = max_kernel_loops.described(cubin("sm90_mha", (384, 1, 1), 168))
    assert max_kernel_loops.summary(declared, "") == "sm90_mha: 384 threads, 168 registers"


def test_a_cache_is_read_as_a_directory_or_as_its_archive(tmp_path):
    kernel = cubin("mha_decode", (128, 1, 1), 96)
    (tmp_path / "cache" / "mojo").mkdir(parents=True)
    (tmp_path / "cache" / "mojo" / "module").write_bytes(b"header" + kernel)
    archive = tmp_path / "cache.tar.gz"
    member = tarfile.TarInfo("modular/module")
    member.size = len(b"header" + kernel)
    with tarfile.open(archive, "w:gz") as tar:
        tar.addfile(member, io.BytesIO(b"header" + kernel))
    for source in (tmp_path / "cache", archive):
        blobs = list(max_kernel_loops.cache_files(source))
        assert [list(max_kernel_loops.cubins(blob)) for blob in blobs] == [[kernel]]
