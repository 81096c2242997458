"""MAX 26.7's own paged KV cache behind the pipeline's `CacheBackend`: MAX's
`PagedKVCacheManager`, MAX's KV store ops and MAX's flash attention, in the same
Llama graph as mokv's cache (`mokv_examples.pipeline.MokvCache`), so the two can
be compared token for token and timed side by side. Needs `max[serve]`.

MAX's CPU attention kernel specialises on the page size (see `max_attention.py`),
so a graph built here serves managers of the page size it was built for only.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
from max import tree
from max.dtype import DType
from max.engine import InferenceSession
from max.graph import BufferType, DeviceRef, TensorType, TensorValue, Value, ops
from max.nn.attention.mask_config import MHAMaskVariant
from max.nn.kernels import flash_attention_ragged, store_k_cache_ragged, store_v_cache_ragged
from max.nn.kv_cache import MHAKVCacheParams

from mokv import InsufficientBlocksError, KVCacheParams
from mokv.context import MaxTextContextAdapter


def max_params(params: KVCacheParams) -> MHAKVCacheParams:
    """MAX's cache parameters with `params`' geometry, on the CPU."""
    return MHAKVCacheParams(
        dtype=params.dtype,
        n_kv_heads=params.n_kv_heads,
        head_dim=params.head_dim,
        num_layers=params.num_layers,
        page_size=params.page_size,
        devices=[DeviceRef.CPU()],
        enable_prefix_caching=params.enable_prefix_caching,
    )


class MaxCacheAttention:
    """`AttentionBackend` over MAX's paged cache inputs: each layer stores its new
    K/V with MAX's `store_k_cache_ragged`/`store_v_cache_ragged` and attends with
    MAX's causal `flash_attention_ragged`."""

    def __init__(self, params: KVCacheParams) -> None:
        self.params = max_params(params)

    @property
    def custom_extensions(self) -> list:
        return []

    def input_types(self) -> list[TensorType | BufferType]:
        return tree.flatten(self.params.get_symbolic_inputs())[0]

    def __call__(
        self,
        layer_idx: int,
        q: TensorValue,
        k: TensorValue,
        v: TensorValue,
        input_row_offsets: TensorValue,
        graph_inputs: Sequence[Value],
    ) -> TensorValue:
        (cache,) = self.params.unflatten_kv_inputs(iter(graph_inputs))
        layer = ops.constant(layer_idx, DType.uint32, DeviceRef.CPU())
        store_k_cache_ragged(cache, k, input_row_offsets, layer)
        store_v_cache_ragged(cache, v, input_row_offsets, layer)
        scale = 1.0 / math.sqrt(int(q.shape[-1]))
        return flash_attention_ragged(
            self.params, q, input_row_offsets, cache, layer, MHAMaskVariant.CAUSAL_MASK, scale
        )


class MaxRequestContext(MaxTextContextAdapter):
    """MAX's `TextContext` seen through the calls the scheduler makes on mokv's: mokv's
    adapter of MAX's context (what mokv's manager reads) plus the scheduler's calls."""

    def __init__(self, request_id: str, tokens: npt.NDArray[np.int64]) -> None:
        from max.pipelines.context import TextContext, TokenBuffer
        from max.pipelines.modeling.types import RequestID

        super().__init__(
            TextContext(
                request_id=RequestID(request_id), max_length=1 << 20, tokens=TokenBuffer(np.array(tokens, np.int64))
            )
        )

    @property
    def next_tokens(self) -> npt.NDArray[np.int64]:
        return np.asarray(self.context.tokens.active, np.int64)

    def update(self, token: int) -> None:
        self.context.update(token)

    def skip_processing(self, n: int) -> None:
        self.context.tokens.skip_processing(n)


class _Flat:
    """MAX's runtime inputs, flattened in the order of their symbolic types."""

    def __init__(self, inputs: Any) -> None:
        self.inputs = inputs

    def flatten(self) -> list[Any]:
        return tree.flatten(self.inputs)[0]


class MaxCacheManager:
    """MAX's `PagedKVCacheManager` with the calls mokv's scheduler makes (one
    replica; requests are claimed by id, then allocated with their context)."""

    def __init__(self, params: KVCacheParams, session: InferenceSession, num_pages: int, max_batch_size: int) -> None:
        from max.pipelines.kv_cache import PagedKVCacheManager

        self.total_num_pages = num_pages
        self.max_batch_size = max_batch_size
        self.manager = PagedKVCacheManager(
            params=max_params(params), session=session, total_num_pages=num_pages, max_batch_size=max_batch_size
        )
        self._claimed: set[Hashable] = set()
        self._contexts: dict[Hashable, Any] = {}

    def claim(self, request_id: Hashable) -> None:
        self._claimed.add(request_id)

    def alloc(self, ctx: MaxRequestContext) -> None:
        from max._kv_core import InsufficientBlocksError as MaxInsufficientBlocksError

        if ctx.request_id in self._claimed:
            self.manager.claim(ctx.context, 0)
            self._claimed.discard(ctx.request_id)
            self._contexts[ctx.request_id] = ctx.context
        try:
            self.manager.alloc(ctx.context)
        except MaxInsufficientBlocksError as error:
            raise InsufficientBlocksError(str(error)) from error

    def release(self, request_id: Hashable) -> None:
        self._claimed.discard(request_id)
        context = self._contexts.pop(request_id, None)
        if context is not None:
            self.manager.release(context)

    def runtime_inputs_for_leaf(self, batches: Sequence[Sequence[MaxRequestContext]]) -> _Flat:
        return _Flat(self.manager.runtime_inputs([[ctx.context for ctx in batch] for batch in batches]))

    def step(self, batches: Sequence[Sequence[MaxRequestContext]]) -> None:
        for batch in batches:
            for ctx in batch:  # MAX 26.7 commits one request per call
                self.manager.step(ctx.context)

    def get_num_used_pages(self) -> int:
        count = self.manager.block_count(0)
        return count.total - count.free

    def get_metrics_aggregated(self) -> Any:
        return self.manager.get_metrics_aggregated()

    def shutdown(self) -> None:
        """Nothing runs in the background here (no tiers)."""

    def reset_metrics(self) -> None:
        self.manager.take_metrics_aggregated()


class MaxCache:
    """`CacheBackend` for MAX 26.7's own paged cache (the reference)."""

    name = "MAX"

    def attention(self, params: KVCacheParams) -> MaxCacheAttention:
        if params.dtype != DType.float32:
            raise ValueError(f"the MAX cache backend here stores float32 KV, not {params.dtype.name}")
        self.page_size = params.page_size
        return MaxCacheAttention(params)

    def manager(
        self,
        params: KVCacheParams,
        session: InferenceSession,
        num_pages: int,
        max_batch_size: int,
        host_pages: int = 0,
        connectors: object | None = None,
    ) -> MaxCacheManager:
        if host_pages or connectors is not None:
            raise ValueError("the MAX cache backend here has no host, disk or remote KV tier")
        if params.page_size != self.page_size:
            raise ValueError(
                f"this graph runs MAX's attention kernel built for pages of {self.page_size} tokens, "
                f"not {params.page_size}"
            )
        return MaxCacheManager(params, session, num_pages, max_batch_size)

    def context(
        self, request_id: str, tokens: npt.NDArray[np.int64], cache_salt: str | None = None
    ) -> MaxRequestContext:
        if cache_salt is not None:
            raise ValueError("the MAX cache backend here takes no cache salt")
        return MaxRequestContext(request_id, tokens)
