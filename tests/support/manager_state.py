"""Everything observable about a manager, as plain data that compares with `==`.

The bad-input test snapshots a manager before and after each refused call; the
property tests use the same reading to compare a manager with its twin. The
snapshot reaches into internals on purpose: the free queue's order, reference
counts, the prefix index, the host tier's LRU and pages, metrics, the request
set and page-table rows are exactly what a refused call must not touch.
"""

from __future__ import annotations

import hashlib
from dataclasses import asdict
from typing import Any

from mokv import ContinuousBatchingKVCacheManager, PagedKVCacheManager
from mokv.prefix import PageIndex


def _digest(arrays: Any) -> str:
    h = hashlib.sha1()
    for a in arrays:
        h.update(a.tobytes())
    return h.hexdigest()


def _index(index: PageIndex) -> dict[int, tuple]:
    return {
        h: (page, index.uid[page], index.parent_uid[page], index.parent_hash[page], index.tokens[page].tobytes())
        for h, page in index._by_hash.items()
    }


def paged_snapshot(m: PagedKVCacheManager, *, identities: bool = True) -> dict[str, Any]:
    """The manager's whole observable state. With `identities`, which context
    object each request was last seen with (for before/after on one manager;
    twins built apart hold different objects)."""
    replicas = []
    for r in m._replicas:
        pool = r.pool
        requests = {
            rid: (
                st.row,
                st.num_pages,
                tuple(r.table.read(st.row, 0, st.num_pages)),
                st.num_committed,
                st.last_uid,
                st.chain_broken,
                st.is_dummy,
                id(st.source) if identities else None,
            )
            for rid, st in r.requests.items()
        }
        host = None
        if r.host is not None:
            host = (
                list(r.host._lru),
                list(r.host._empty),
                _index(r.host.index),
                _digest(p.to_numpy() for p in r.host._pages),
            )
        replicas.append(
            {
                "free": pool.free_order(),
                "ref_count": list(pool.ref_count),
                "last_uid": pool._last_uid,
                "index": _index(pool.index),
                "host": host,
                "metrics": asdict(r.metrics),
                "requests": requests,
                "table": (r.table._table.shape, r.table._table.tobytes(), list(r.table._free_rows)),
                "pages": _digest(v.to_numpy() for b in r.buffers.values() for v in b.values),
            }
        )
    return {"replica_of": {rid: r.index for rid, r in m._requests.replica_of.items()}, "replicas": replicas}


def continuous_snapshot(m: ContinuousBatchingKVCacheManager, *, identities: bool = True) -> dict[str, Any]:
    """The continuous manager's observable state (see `paged_snapshot`)."""
    return {
        "slot_of": dict(m._slot_of),
        "free": list(m._free),
        "lengths": m._lengths.tolist(),
        "contexts": {rid: id(src) if identities else None for rid, (src, _) in m._context_of.items()},
        "blocks": _digest(b.to_numpy() for b in m.blocks),
    }
