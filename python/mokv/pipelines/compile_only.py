"""The manager a MAX pipeline gets in compile-only mode (`max warm-cache --target`).

With `--target` MAX compiles a pipeline's graphs for a device that is not there (its
virtual devices), and no memory can be allocated on one; MAX's own `load_kv_manager`
then returns a `unittest.mock.Mock`. mokv's seam returns this instead: it checks the
cache settings as the real manager would, holds no pages, and refuses every request
call by name, so that nothing can run against a cache that does not exist.
"""

from __future__ import annotations

from typing import NoReturn

from ..params import KVCacheParams


class CompileOnlyKVCacheManager:
    """No cache, for a pipeline compiled for a virtual device: `params` and the pool's
    size are what the real manager would have had; any other attribute raises an
    `AttributeError` that says why (so `hasattr` and `getattr(..., default)` probes
    still answer as for a missing attribute)."""

    def __init__(self, params: KVCacheParams, total_num_pages: int) -> None:
        self.params = params
        self.total_num_pages = total_num_pages

    def __getattr__(self, name: str) -> NoReturn:
        raise AttributeError(
            f"{name}: this pipeline was built in compile-only mode (MAX's virtual devices, "
            "`max warm-cache --target`): mokv's KV cache holds no pages there and serves no request"
        )
