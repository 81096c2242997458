"""Every public entry point of PagedKVCacheManager, tried as a hostile or careless caller would.

Each case is a call that must be refused: it raises the documented exception
type, the message names the bad value, and the manager's whole observable
state (`tests.support.manager_state`) is exactly as before. For the managers a twin,
built the same way but never given the bad call, then runs the same follow-up
workload: both must behave identically afterwards.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from max.dtype import DType
from max.graph import DeviceRef

from mokv import (
    InsufficientBlocksError,
    KVCacheParams,
    PagedKVCacheManager,
    TextContext,
)
from mokv.paged import BatchCharacteristics
from tests.support.manager_state import paged_snapshot
from tests.support.refusals import BASE, HUGE, NAN, Case, P, cases, ctx, raises_naming, second

PAGE = 4
PREFIX = list(range(100, 112))  # three full pages, cached by `old`


def paged_manager(**kw: Any) -> PagedKVCacheManager:
    p = KVCacheParams(
        DType.float32,
        1,
        2,
        1,
        page_size=PAGE,
        enable_prefix_caching=True,
        data_parallel_degree=2,
        devices=[DeviceRef.CPU()] * 2,
    )
    return PagedKVCacheManager(p, None, kw.pop("total_num_pages", 16), 4, True, max_batch_size=3, **kw)


def paged_world() -> tuple[PagedKVCacheManager, dict[str, TextContext]]:
    """Two replicas. Replica 0: `a` (ran a step; `step` would commit its pages),
    `b` (allocated), `e` (claimed, no pages), `pad` (dummy), and `old`'s
    prefix cached in the free queue. Replica 1: `c`. `d` was released."""
    m = paged_manager()
    c = {
        "old": ctx("old", [*PREFIX, 1]),
        "a": ctx("a", range(10)),
        "b": ctx("b", range(50, 55)),
        "c": ctx("c", range(7)),
        "d": ctx("d", [9, 9]),
        "e": ctx("e", [5] * 6),
        "pad": ctx("pad", [0]),
    }
    for rid, replica in (("old", 0), ("a", 0), ("b", 0), ("c", 1), ("d", 0)):
        m.claim(rid, replica)
        m.alloc(c[rid], replica)
    c["old"].update(7)
    m.step([[c["old"]], []])
    m.release("old")
    m.release("d")
    m.claim("e")
    m.alloc_dummy("pad")
    m.runtime_inputs([[c["a"], c["b"]], [c["c"]]])
    c["a"].update(3)
    return m, c


def paged_follow_up(m: PagedKVCacheManager, c: dict[str, TextContext]) -> list:
    """What the manager does next: the live requests step and finish, new ones
    reuse the cached prefixes, the cache is reset."""
    seen: list = []
    m.step([[c["a"], c["b"]], [c["c"]]])
    for rid, replica in (("a", 0), ("b", 0), ("c", 1), ("e", 0), ("pad", 0)):
        m.release(rid, replica)
    for i, tokens in enumerate([[*PREFIX, 5, 6], [*range(10), 3, 4], [7] * 20]):
        new = ctx(f"n{i}", tokens)
        m.claim(new.request_id, i % 2)
        m.alloc(new, i % 2, num_steps=2)
        seen.append((m.get_req_blocks(new.request_id, i % 2), new.processed_length))
        m.release(new.request_id, i % 2)
    m.reset_prefix_cache()
    seen.append(m.get_metrics_aggregated())
    return seen


def ran(rid: str, tokens: Any) -> TextContext:
    """A context that ran its prompt through the model (without pages)."""
    c = ctx(rid, tokens)
    c.update(1)
    return c


def batches(*names: str, other: tuple[str, ...] = ("c",)) -> Callable:
    return lambda m, c: [[c.get(n) or ctx(n, [1]) for n in names], [c[n] for n in other]]


def _reserve(m: PagedKVCacheManager, replica_batches: Any) -> None:
    with m.reserve(replica_batches):
        pass  # pragma: no cover - every reservation below is refused


PAGED_CASES = cases(
    # claim / alloc_dummy / contains / release: ids and replicas
    ("claim-bool-id", lambda m, c: m.claim(True), TypeError, "True"),
    ("claim-float-id", lambda m, c: m.claim(1.5), TypeError, "1.5"),
    ("claim-nan-id", lambda m, c: m.claim(NAN), TypeError, "nan"),
    ("claim-none-id", lambda m, c: m.claim(None), TypeError, "None"),
    ("claim-list-id", lambda m, c: m.claim(["x"]), TypeError, "['x']"),
    ("claim-twice", lambda m, c: m.claim("a", 1), ValueError, "'a'"),
    ("claim-no-replica", lambda m, c: m.claim("z", 2), ValueError, "replica_idx=2"),
    ("claim-negative-replica", lambda m, c: m.claim("z", -1), ValueError, "replica_idx=-1"),
    ("claim-bool-replica", lambda m, c: m.claim("z", True), TypeError, "True"),
    ("claim-float-replica", lambda m, c: m.claim("z", 0.0), TypeError, "0.0"),
    ("claim-str-replica", lambda m, c: m.claim("z", "0"), TypeError, "'0'"),
    ("dummy-twice", lambda m, c: m.alloc_dummy("pad"), ValueError, "'pad'"),
    ("dummy-bool-id", lambda m, c: m.alloc_dummy(False), TypeError, "False"),
    ("contains-list-id", lambda m, c: m.contains(["a"]), TypeError, "['a']"),
    ("release-released", lambda m, c: m.release("d"), ValueError, "'d'"),
    ("release-wrong-replica", lambda m, c: m.release("a", 1), ValueError, "'a'"),
    ("release-bool-id", lambda m, c: m.release(True), TypeError, "True"),
    ("release-no-replica", lambda m, c: m.release("a", 5), ValueError, "replica_idx=5"),
    # alloc
    ("alloc-steps-zero", lambda m, c: m.alloc(c["b"], num_steps=0), ValueError, "num_steps must be >= 1, got 0"),
    ("alloc-steps-negative", lambda m, c: m.alloc(c["b"], num_steps=-2), ValueError, "-2"),
    ("alloc-steps-fraction", lambda m, c: m.alloc(c["b"], num_steps=1.5), TypeError, "1.5"),
    ("alloc-steps-one-float", lambda m, c: m.alloc(c["b"], num_steps=1.0), TypeError, "1.0"),
    ("alloc-steps-bool", lambda m, c: m.alloc(c["b"], num_steps=True), TypeError, "True"),
    ("alloc-steps-nan", lambda m, c: m.alloc(c["b"], num_steps=NAN), TypeError, "nan"),
    ("alloc-steps-str", lambda m, c: m.alloc(c["b"], num_steps="2"), TypeError, "'2'"),
    ("alloc-steps-huge", lambda m, c: m.alloc(c["b"], num_steps=HUGE), InsufficientBlocksError, f"num_steps={HUGE}"),
    ("alloc-released", lambda m, c: m.alloc(c["d"]), ValueError, "'d'"),
    ("alloc-never-claimed", lambda m, c: m.alloc(ctx("ghost", [1, 2])), ValueError, "'ghost'"),
    ("alloc-wrong-replica", lambda m, c: m.alloc(c["c"], 0), ValueError, "'c'"),
    ("alloc-other-tokens", lambda m, c: m.alloc(second("b", [50, 51, 99])), ValueError, "'b'"),
    ("alloc-dummy", lambda m, c: m.alloc(ctx("pad", [0])), ValueError, "'pad'"),
    ("alloc-not-a-context", lambda m, c: m.alloc("b"), TypeError, "str"),
    ("alloc-float-id", lambda m, c: m.alloc(ctx(2.5, [1])), TypeError, "2.5"),
    ("alloc-no-replica", lambda m, c: m.alloc(c["b"], 3), ValueError, "replica_idx=3"),
    ("alloc-too-long", lambda m, c: m.alloc(ctx("e", [5] * 80)), InsufficientBlocksError, "current_length 80"),
    ("alloc-no-room", lambda m, c: m.alloc(c["e"], num_steps=40), InsufficientBlocksError, "'e'"),
    # step
    ("step-too-few-batches", lambda m, c: m.step([[c["a"]]]), ValueError, "got 1"),
    ("step-too-many-batches", lambda m, c: m.step([[c["a"]], [c["c"]], []]), ValueError, "got 3"),
    ("step-not-a-list", lambda m, c: m.step("ab"), TypeError, "'ab'"),
    ("step-batch-none", lambda m, c: m.step([None, [c["c"]]]), TypeError, "None"),
    ("step-twice-in-batch", lambda m, c: m.step(batches("a", "a")(m, c)), ValueError, "'a'"),
    ("step-unclaimed-after", lambda m, c: m.step(batches("a", "d")(m, c)), ValueError, "'d'"),
    ("step-ghost-after", lambda m, c: m.step(batches("a", "ghost")(m, c)), ValueError, "'ghost'"),
    ("step-wrong-replica", lambda m, c: m.step(batches("a", "c", other=())(m, c)), ValueError, "'c'"),
    ("step-other-tokens", lambda m, c: m.step([[c["a"], second("b", [7] * 5)], [c["c"]]]), ValueError, "'b'"),
    ("step-over-batch-size", lambda m, c: m.step(batches("a", "b", "e", "pad")(m, c)), ValueError, "4 requests"),
    ("step-not-allocated", lambda m, c: m.step([[c["a"], ran("e", [5] * 6)], [c["c"]]]), ValueError, "'e'"),
    # runtime_inputs
    ("inputs-too-few-batches", lambda m, c: m.runtime_inputs([[c["b"]]]), ValueError, "got 1"),
    ("inputs-too-many-batches", lambda m, c: m.runtime_inputs([[], [], []]), ValueError, "got 3"),
    ("inputs-twice-in-batch", lambda m, c: m.runtime_inputs(batches("b", "b")(m, c)), ValueError, "'b'"),
    ("inputs-unclaimed-after", lambda m, c: m.runtime_inputs(batches("b", "d")(m, c)), ValueError, "'d'"),
    ("inputs-no-pages", lambda m, c: m.runtime_inputs(batches("b", "e")(m, c)), ValueError, "'e'"),
    (
        "inputs-over-batch-size",
        lambda m, c: m.runtime_inputs(batches("a", "b", "e", "pad")(m, c)),
        ValueError,
        "4 requests",
    ),
    ("inputs-steps-zero", lambda m, c: m.runtime_inputs([[], []], num_steps=0), ValueError, "0"),
    ("inputs-steps-fraction", lambda m, c: m.runtime_inputs([[], []], num_steps=2.5), TypeError, "2.5"),
    ("inputs-steps-huge", lambda m, c: m.runtime_inputs([[], []], num_steps=HUGE), ValueError, str(HUGE)),
    ("inputs-width-zero", lambda m, c: m.runtime_inputs([[], []], max_cache_length=0), ValueError, "0"),
    ("inputs-width-bool", lambda m, c: m.runtime_inputs([[], []], max_cache_length=True), TypeError, "True"),
    ("inputs-width-huge", lambda m, c: m.runtime_inputs([[], []], max_cache_length=HUGE), ValueError, str(HUGE)),
    (
        "inputs-width-short",
        lambda m, c: m.runtime_inputs(batches("b")(m, c), max_cache_length=4),
        ValueError,
        "max_cache_length=4",
    ),
    (
        "inputs-characteristics",
        lambda m, c: m.runtime_inputs([[], []], batch_characteristics=(1, 2, 3)),
        TypeError,
        "(1, 2, 3)",
    ),
    (
        "inputs-characteristics-exceeded",
        lambda m, c: m.runtime_inputs(batches("b")(m, c), batch_characteristics=BatchCharacteristics(1, 1, 1)),
        ValueError,
        "exceeds",
    ),
    # reserve
    ("reserve-claimed", lambda m, c: _reserve(m, [[ctx("r1", [1]), c["b"]], []]), ValueError, "'b'"),
    ("reserve-twice", lambda m, c: _reserve(m, [[ctx("r1", [1]), ctx("r1", [2])], []]), ValueError, "'r1'"),
    ("reserve-batches", lambda m, c: _reserve(m, [[ctx("r1", [1])]]), ValueError, "got 1"),
    (
        "reserve-no-room",
        lambda m, c: _reserve(m, [[ctx("r1", [1]), ctx("r2", range(64))], []]),
        InsufficientBlocksError,
        "'r2' needs 16 new pages on replica 0",
    ),
    # queries
    ("blocks-released", lambda m, c: m.get_req_blocks("d"), ValueError, "'d'"),
    ("used-pages-no-replica", lambda m, c: m.get_num_used_pages(2), ValueError, "replica_idx=2"),
    ("free-blocks-float-replica", lambda m, c: m.num_free_blocks(1.0), TypeError, "1.0"),
    ("buffer-negative-replica", lambda m, c: m.get_device_buffer(-1), ValueError, "-1"),
    ("pct-float-id", lambda m, c: m.get_pct_used_blocks_after_allocation(ctx(1.5, [1])), TypeError, "1.5"),
)


@pytest.mark.parametrize("case", PAGED_CASES)
def test_paged_manager_refuses_and_changes_nothing(case: Case) -> None:
    m, c = paged_world()
    twin, twin_c = paged_world()
    before = paged_snapshot(m)
    context_state = {rid: (x.processed_length, x.current_length, x.cached_prefix_length) for rid, x in c.items()}
    raises_naming(case, m, c)
    assert paged_snapshot(m) == before
    assert {rid: (x.processed_length, x.current_length, x.cached_prefix_length) for rid, x in c.items()} == (
        context_state
    )
    assert paged_follow_up(m, c) == paged_follow_up(twin, twin_c)
    assert paged_snapshot(m, identities=False) == paged_snapshot(twin, identities=False)


PAGED_CONSTRUCTOR_CASES = cases(
    ("pages-zero", lambda: paged_manager(total_num_pages=0), ValueError, "total_num_pages must be >= 1, got 0"),
    ("pages-negative", lambda: paged_manager(total_num_pages=-3), ValueError, "-3"),
    ("pages-fraction", lambda: paged_manager(total_num_pages=7.5), TypeError, "7.5"),
    ("pages-bool", lambda: paged_manager(total_num_pages=True), TypeError, "True"),
    ("pages-str", lambda: paged_manager(total_num_pages="8"), TypeError, "'8'"),
    ("pages-huge", lambda: paged_manager(total_num_pages=HUGE), ValueError, f"total_num_pages={HUGE}"),
    (
        "host-pages-huge",
        lambda: PagedKVCacheManager(KVCacheParams(**BASE, enable_prefix_caching=True), None, 8, HUGE, max_batch_size=2),
        ValueError,
        f"total_num_host_pages={HUGE}",
    ),
    ("host-pages-negative", lambda: PagedKVCacheManager(P, None, 8, -1, max_batch_size=2), ValueError, "-1"),
    (
        "host-without-prefix",
        lambda: PagedKVCacheManager(P, None, 8, 4, max_batch_size=2),
        ValueError,
        "total_num_host_pages=4",
    ),
    ("batch-huge", lambda: PagedKVCacheManager(P, None, 8, max_batch_size=HUGE), ValueError, f"max_batch_size={HUGE}"),
    ("batch-zero", lambda: PagedKVCacheManager(P, None, 8, max_batch_size=0), ValueError, "0"),
    ("batch-float", lambda: PagedKVCacheManager(P, None, 8, max_batch_size=2.0), TypeError, "2.0"),
    ("checks-str", lambda: PagedKVCacheManager(P, None, 8, 0, "yes", max_batch_size=2), TypeError, "'yes'"),
    ("session-str", lambda: PagedKVCacheManager(P, "session", 8, max_batch_size=2), TypeError, "'session'"),
    (
        "continuous-params",
        lambda: PagedKVCacheManager(KVCacheParams(**BASE, cache_strategy="continuous"), None, 8, max_batch_size=2),
        ValueError,
        "continuous",
    ),
    ("params-dict", lambda: PagedKVCacheManager(BASE, None, 8, max_batch_size=2), TypeError, "dict"),
)


@pytest.mark.parametrize("case", PAGED_CONSTRUCTOR_CASES)
def test_paged_constructor_refuses(case: Case) -> None:
    raises_naming(case)
