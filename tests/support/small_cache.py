"""Small paged caches (float32, one layer, one KV head, head_dim 2) that build in
milliseconds: what the manager's unit and property tests run on, and the
helpers those tests share (`admit`, `run_request`, `lookup`)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from max.dtype import DType
from max.graph import DeviceRef

from mokv import KVCacheParams, PagedKVCacheManager, TextContext

MakeManager = Callable[..., PagedKVCacheManager]


def small_paged_manager(
    page_size: int = 4,
    total_num_pages: int = 16,
    *,
    prefix_caching: bool = True,
    data_parallel_degree: int = 1,
    total_num_host_pages: int = 0,
    max_batch_size: int = 8,
    checks: bool = True,
) -> PagedKVCacheManager:
    """A manager over a small cache, with its runtime invariant checks on unless asked otherwise."""
    params = KVCacheParams(
        DType.float32,
        n_kv_heads=1,
        head_dim=2,
        num_layers=1,
        page_size=page_size,
        enable_prefix_caching=prefix_caching,
        data_parallel_degree=data_parallel_degree,
        devices=[DeviceRef.CPU()] * data_parallel_degree,
    )
    return PagedKVCacheManager(
        params,
        None,
        total_num_pages,
        total_num_host_pages,
        enable_runtime_checks=checks,
        max_batch_size=max_batch_size,
    )


def ctx(request_id: str, tokens: list[int] | np.ndarray) -> TextContext:
    """A context with `tokens` as its prompt."""
    return TextContext(request_id, np.asarray(tokens, dtype=np.int64))


def admit(m: PagedKVCacheManager, *contexts: TextContext) -> None:
    """Claims and allocates each context on replica 0, in order."""
    for c in contexts:
        m.claim(c.request_id)
        m.alloc(c)


def run_request(m: PagedKVCacheManager, c: TextContext, decode: int = 1, replica: int = 0) -> None:
    """claim, alloc, then `decode` model steps (update, step, alloc), then release."""
    m.claim(c.request_id, replica)
    m.alloc(c, replica)
    batches = [[] for _ in range(m.num_replicas)]
    batches[replica] = [c]
    for i in range(decode):
        m.runtime_inputs(batches)
        c.update(1000 + i)
        m.step(batches)
        m.alloc(c, replica)
    m.release(c.request_id, replica)


def lookup(m: PagedKVCacheManager, batch: list[TextContext], **kw) -> tuple[np.ndarray, ...]:
    """The batch's runtime tables on replica 0 as numpy: cache lengths, lookup table, max lengths."""
    (inputs,) = m.runtime_inputs([batch], **kw).inputs
    return tuple(b.to_numpy() for b in inputs.flatten()[1:])
