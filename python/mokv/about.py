"""What is installed and where: the versions of mokv, MAX and Mojo, where mokv's kernel
sources are and where its caches go. `python -m mokv` and `mokv --version` print `report()`;
paste it into a bug report."""

from __future__ import annotations

import os
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from .kernels import kernel_source_names, kernel_sources_root, mojo_compiler
from .paths import CACHE_ENV, MODULAR_CACHE_ENV, cache_dir, compiled_graphs_dir, precompiled_kernels_dir


def installed_version(distribution: str) -> str:
    """The installed version of `distribution`, or "not installed"."""
    try:
        return version(distribution)
    except PackageNotFoundError:
        return "not installed"


def _cache_origin() -> str:
    if os.environ.get(CACHE_ENV):
        return f"from ${CACHE_ENV}"
    if os.path.isabs(os.environ.get("XDG_CACHE_HOME", "")):
        return "per user: $XDG_CACHE_HOME/mokv; $MOKV_CACHE_DIR overrides"
    return f"per user: ~/.cache/mokv; ${CACHE_ENV} overrides"


def _compiled_graphs() -> str:
    if os.environ.get(MODULAR_CACHE_ENV):
        return f"{os.environ[MODULAR_CACHE_ENV]} (from ${MODULAR_CACHE_ENV})"
    return f"MAX's default, $XDG_CACHE_HOME/modular or ~/.cache/modular (the mokv command uses {compiled_graphs_dir()})"


def report() -> str:
    """A few lines naming the versions of mokv, MAX and Mojo and the folders mokv reads
    kernels from and caches into."""
    try:
        compiler = mojo_compiler()
    except RuntimeError as missing:
        compiler = str(missing)
    return "\n".join(
        [
            f"mokv {installed_version('mokv')} ({Path(__file__).parent})",
            f"MAX {installed_version('max')}",
            f"Mojo {installed_version('mojo')} (compiler: {compiler})",
            f"kernel sources: {kernel_sources_root()} ({', '.join(kernel_source_names())})",
            f"mokv cache: {cache_dir()} ({_cache_origin()})",
            f"  precompiled kernels: {precompiled_kernels_dir()}",
            f"compiled graphs: {_compiled_graphs()}",
        ]
    )
