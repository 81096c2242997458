"""Two paged KV cache managers behind one small interface, driven alike by the
manager benchmark (`mokv bench manager`) and the lockstep test
(`tests/paged/test_manager_vs_max.py`): mokv's `PagedKVCacheManager` and MAX 26.7's
own, the reference (which needs `max[serve]`)."""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np
from max.driver import CPU
from max.dtype import DType
from max.engine import InferenceSession
from max.graph import DeviceRef

from mokv import KVCacheParams, PagedKVCacheManager, TextContext


class Backend(Protocol):
    """A paged KV cache manager driven through one common interface."""

    def new_context(self, request_id: str, tokens: np.ndarray) -> Any: ...
    def claim(self, ctx: Any) -> None: ...
    def alloc(self, ctx: Any) -> None: ...
    def runtime_inputs(self, batch: list[Any]) -> Any: ...
    def step(self, batch: list[Any]) -> None: ...
    def release(self, ctx: Any) -> None: ...
    def blocks(self, ctx: Any) -> list[int]: ...
    def num_free_blocks(self) -> int: ...
    def hit_rate(self) -> float: ...


class MokvBackend:
    """mokv's `PagedKVCacheManager` on replica 0."""

    def __init__(self, page_size: int, total_num_pages: int, max_batch_size: int) -> None:
        params = KVCacheParams(
            DType.float32,
            n_kv_heads=1,
            head_dim=8,
            num_layers=1,
            page_size=page_size,
            enable_prefix_caching=True,
        )
        self.manager = PagedKVCacheManager(
            params,
            InferenceSession(devices=[CPU()]),
            total_num_pages,
            max_batch_size=max_batch_size,
        )

    def new_context(self, request_id: str, tokens: np.ndarray) -> TextContext:
        return TextContext(request_id, tokens)

    def claim(self, ctx: TextContext) -> None:
        self.manager.claim(ctx.request_id, 0)

    def alloc(self, ctx: TextContext) -> None:
        self.manager.alloc(ctx, 0)

    def runtime_inputs(self, batch: list[TextContext]) -> Any:
        return self.manager.runtime_inputs([batch])

    def step(self, batch: list[TextContext]) -> None:
        self.manager.step([batch])

    def release(self, ctx: TextContext) -> None:
        self.manager.release(ctx.request_id, 0)

    def blocks(self, ctx: TextContext) -> list[int]:
        return self.manager.get_req_blocks(ctx.request_id, 0)

    def num_free_blocks(self) -> int:
        return self.manager.num_free_blocks(0)

    def hit_rate(self) -> float:
        return self.manager.get_metrics_aggregated().cache_hit_rate


class MaxBackend:
    """MAX 26.7's own `PagedKVCacheManager` (needs `max[serve]`), the reference."""

    def __init__(self, page_size: int, total_num_pages: int, max_batch_size: int) -> None:
        from max.nn.kv_cache import MHAKVCacheParams
        from max.pipelines.kv_cache import PagedKVCacheManager as MaxManager

        params = MHAKVCacheParams(
            dtype=DType.float32,
            n_kv_heads=1,
            head_dim=8,
            num_layers=1,
            page_size=page_size,
            devices=[DeviceRef.CPU()],
            enable_prefix_caching=True,
        )
        self.manager = MaxManager(
            params=params,
            session=InferenceSession(devices=[CPU()]),
            total_num_pages=total_num_pages,
            max_batch_size=max_batch_size,
        )

    def new_context(self, request_id: str, tokens: np.ndarray) -> Any:
        from max.pipelines.context import TextContext as MaxContext
        from max.pipelines.context import TokenBuffer
        from max.pipelines.modeling.types import RequestID

        return MaxContext(
            request_id=RequestID(request_id),
            max_length=1 << 20,
            tokens=TokenBuffer(tokens.copy()),
        )

    def claim(self, ctx: Any) -> None:
        self.manager.claim(ctx, 0)

    def alloc(self, ctx: Any) -> None:
        self.manager.alloc(ctx)

    def runtime_inputs(self, batch: list[Any]) -> Any:
        return self.manager.runtime_inputs([batch])

    def step(self, batch: list[Any]) -> None:
        for ctx in batch:  # MAX 26.7 commits one request per call
            self.manager.step(ctx)

    def release(self, ctx: Any) -> None:
        self.manager.release(ctx)

    def blocks(self, ctx: Any) -> list[int]:
        (blocks,) = self.manager.get_req_blocks_per_leaf(ctx).values()
        return blocks

    def num_free_blocks(self) -> int:
        return self.manager.block_count(0).free

    def hit_rate(self) -> float:
        return self.manager.get_metrics_aggregated().cache_hit_rate
