"""Finding mokv's Mojo kernel packages and precompiling them once.

Every Mojo package under the checkout's `mojo/` (`mokv_kernels`, and any added beside it)
travels inside the installed `mokv` package as `mokv/mojo/<name>/`, sources only:
`kernel_source_dir(name)` finds it through `importlib.resources`, so an installed wheel, an
editable checkout and a sdist build all resolve the same way. A precompiled package is tied
to the exact Mojo compiler that built it, so it is built on the user's machine, not shipped.

MAX precompiles a kernel *directory* every time a graph names it (~6 s); a prebuilt
`.mojoc` loads in ~2 s. `kernel_package` precompiles once per source revision into
`mokv.paths.precompiled_kernels_dir()`, keyed by a hash of the sources, so edits rebuild
and reruns don't.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from functools import cache
from importlib.resources import files
from pathlib import Path

from .paths import precompiled_kernels_dir

MOKV_KERNELS = "mokv_kernels"
"""The Mojo package with the cache layouts, store/gather and attention ops."""


def kernel_sources_root() -> Path:
    """The folder holding every Mojo package mokv ships: `mokv/mojo` inside the installed
    package (resolved, so a checkout's link leads to its real `mojo/`)."""
    root = files("mokv") / "mojo"
    if not isinstance(root, Path) or not root.is_dir():
        raise RuntimeError(
            f"mokv's Mojo sources are not a folder on disk at {root}: was mokv installed without its package data?"
        )
    return root.resolve()


def kernel_source_names() -> list[str]:
    """Names of the Mojo packages mokv ships (folders with an `__init__.mojo`), sorted."""
    return sorted(p.name for p in kernel_sources_root().iterdir() if (p / "__init__.mojo").is_file())


def kernel_source_dir(name: str = MOKV_KERNELS) -> Path:
    """The installed source folder of the Mojo package `name`.

    Raises:
        ValueError: mokv ships no Mojo package called `name`; the message lists those it does.
    """
    if not name.isidentifier():
        raise ValueError(f"a Mojo package name is an identifier, got {name!r}; pass a source folder as a Path")
    folder = kernel_sources_root() / name
    if not (folder / "__init__.mojo").is_file():
        raise ValueError(
            f"mokv ships no Mojo package named {name!r} (it has: {', '.join(kernel_source_names())}); "
            f"to build sources from elsewhere, pass their folder as a Path"
        )
    return folder


def _source_digest(src: Path) -> str:
    digest = hashlib.sha256()
    for path in sorted(src.rglob("*.mojo")):
        digest.update(path.relative_to(src).as_posix().encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def mojo_compiler() -> str:
    """The `mojo` compiler to precompile with: the one beside this Python, else the first on PATH."""
    beside_python = Path(sys.executable).with_name("mojo")
    if beside_python.exists():
        return str(beside_python)
    found = shutil.which("mojo")
    if found is None:
        raise RuntimeError("the `mojo` compiler was not found; install mojo==1.2.0")
    return found


@cache
def kernel_package(source: str | Path = MOKV_KERNELS) -> Path:
    """Path of the precompiled Mojo package built from `source`, building it if those
    sources changed: pass it to `Graph(custom_extensions=[...])`.

    `source` is the name of a Mojo package mokv ships (`kernel_source_names()`), or the
    folder of one as a `Path` (a benchmark building another git revision's kernels).

    Raises:
        ValueError: `source` names no package mokv ships.
        RuntimeError: The Mojo compiler is missing or rejects the sources (its message follows).
    """
    source_dir = source if isinstance(source, Path) else kernel_source_dir(source)
    # The file name is the Mojo module name, so the digest names the folder.
    out = precompiled_kernels_dir() / _source_digest(source_dir) / f"{source_dir.name}.mojoc"
    if out.exists():
        return out
    print(f"mokv: precompiling {source_dir} into {out.parent} (once per source revision)", file=sys.stderr)
    # Build in a private folder and rename it into place, so concurrent test
    # runs never see a half-written package.
    staging = out.parents[1] / f"building-{os.getpid()}"
    staging.mkdir(parents=True, exist_ok=True)
    # Importing MAX's Python bindings sets PYTHONEXECUTABLE and PYTHONPATH at
    # the C level, which sends the `mojo` launcher script to the wrong Python;
    # os.environ still holds the environment this process started with.
    result = subprocess.run(
        [mojo_compiler(), "precompile", str(source_dir), "-o", str(staging / out.name)],
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
