"""Locating mokv's Mojo kernel package and precompiling it once.

MAX precompiles a kernel *directory* every time a graph names it (~6 s); a
prebuilt `.mojoc` loads in ~2 s. We precompile once per source revision into the
cache directory, keyed by a hash of the sources, so edits rebuild and reruns
don't.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from functools import cache
from pathlib import Path

KERNEL_SOURCE_DIR = Path(__file__).resolve().parents[2] / "mojo" / "mokv_kernels"


def cache_dir() -> Path:
    """Root of mokv's on-disk caches (`$MOKV_CACHE_DIR`, else the repo's `.cache/`)."""
    return Path(os.environ.get("MOKV_CACHE_DIR", KERNEL_SOURCE_DIR.parents[1] / ".cache"))


def _source_digest(src: Path) -> str:
    digest = hashlib.sha256()
    for path in sorted(src.rglob("*.mojo")):
        digest.update(path.relative_to(src).as_posix().encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def _mojo_binary() -> str:
    beside_python = Path(sys.executable).with_name("mojo")
    if beside_python.exists():
        return str(beside_python)
    found = shutil.which("mojo")
    if found is None:
        raise RuntimeError("the `mojo` compiler was not found; install mojo==1.2.0")
    return found


@cache
def kernel_package(source_dir: Path = KERNEL_SOURCE_DIR) -> Path:
    """Path of the precompiled kernel package built from `source_dir` (mokv's
    own kernels unless a benchmark compares another revision's), building it
    if those sources changed."""
    # The file name is the Mojo module name, so the digest names the folder.
    out = cache_dir() / "mojo" / _source_digest(source_dir) / "mokv_kernels.mojoc"
    if out.exists():
        return out
    # Build in a private folder and rename it into place, so concurrent test
    # runs never see a half-written package.
    staging = out.parents[1] / f"building-{os.getpid()}"
    staging.mkdir(parents=True, exist_ok=True)
    # Importing MAX's Python bindings sets PYTHONEXECUTABLE and PYTHONPATH at
    # the C level, which sends the `mojo` launcher script to the wrong Python;
    # os.environ still holds the environment this process started with.
    result = subprocess.run(
        [_mojo_binary(), "precompile", str(source_dir), "-o", str(staging / out.name)],
        capture_output=True,
        text=True,
        env=dict(os.environ),
        check=False,
    )
    if result.returncode != 0:
        shutil.rmtree(staging, ignore_errors=True)
        raise RuntimeError(f"mojo precompile of {source_dir} failed:\n{result.stderr}")
    try:
        staging.rename(out.parent)
    except OSError:  # another process finished first
        shutil.rmtree(staging, ignore_errors=True)
    return out
