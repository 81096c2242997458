"""Every public entry point, tried as a hostile or careless caller would.

Each case is a call that must be refused: it raises the documented exception
type, the message names the bad value, and the manager's whole observable
state (`tests.manager_state`) is exactly as before. For the managers a twin,
built the same way but never given the bad call, then runs the same follow-up
workload: both must behave identically afterwards.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
from max.driver import CPU, Buffer
from max.dtype import DType
from max.engine import InferenceSession
from max.graph import DeviceRef, Graph, TensorType

from mokv import (
    ContinuousBatchingKVCacheManager,
    InsufficientBlocksError,
    KVCacheBuffer,
    KVCacheParams,
    KVCacheQuantConfig,
    MultiKVCacheParams,
    PagedKVCacheManager,
    TextContext,
)
from mokv.graph import PagedCacheValues, attention, gather_kv, paged_input_types, store_kv
from mokv.paged import BatchCharacteristics
from tests.manager_state import continuous_snapshot, paged_snapshot

HUGE = 10**15
NAN = float("nan")
INF = float("inf")


@dataclass(frozen=True)
class Case:
    """A call that must raise `error` with `names` (a value's repr) in its message."""

    name: str
    call: Callable[..., Any]
    error: type[BaseException]
    names: str


def cases(*rows: tuple) -> list:
    return [pytest.param(Case(*row), id=row[0]) for row in rows]


def raises_naming(case: Case, *args: Any) -> None:
    with pytest.raises(case.error, match=re.escape(case.names)):
        case.call(*args)


# ------------------------------------------------------------------ params

BASE = {"dtype": DType.float32, "n_kv_heads": 2, "head_dim": 8, "num_layers": 2}
P = KVCacheParams(**BASE, page_size=4)
Q = KVCacheParams(
    **{**BASE, "dtype": DType.int8}, page_size=4, kvcache_quant_config=KVCacheQuantConfig(tokens_per_scale=2)
)


def params(**kw: Any) -> Callable[[], Any]:
    return lambda: KVCacheParams(**{**BASE, **kw})


PARAMS_CASES = cases(
    ("heads-bool", params(n_kv_heads=True), TypeError, "True"),
    ("heads-float", params(n_kv_heads=2.0), TypeError, "2.0"),
    ("heads-nan", params(n_kv_heads=NAN), TypeError, "nan"),
    ("heads-str", params(n_kv_heads="2"), TypeError, "'2'"),
    ("heads-none", params(n_kv_heads=None), TypeError, "None"),
    ("layers-zero", params(num_layers=0), ValueError, "num_layers must be >= 1, got 0"),
    ("page-negative", params(page_size=-4), ValueError, "-4"),
    ("page-fraction", params(page_size=1.5), TypeError, "1.5"),
    ("dp-inf", params(data_parallel_degree=INF), TypeError, "inf"),
    ("prefix-str", params(enable_prefix_caching="false"), TypeError, "'false'"),
    ("devices-str", params(devices="cpu"), TypeError, "'cpu'"),
    ("devices-entry", params(devices=["cpu"]), TypeError, "devices[0]"),
    ("swap-nan", params(host_kvcache_swap_space_gb=NAN), ValueError, "nan"),
    (
        "swap-inf",
        params(enable_prefix_caching=True, enable_kvcache_swapping_to_host=True, host_kvcache_swap_space_gb=INF),
        ValueError,
        "inf",
    ),
    ("swap-negative", params(host_kvcache_swap_space_gb=-1.0), ValueError, "-1.0"),
    ("swap-str", params(host_kvcache_swap_space_gb="1"), ValueError, "'1'"),
    ("block-shape-negative", lambda: P.block_shape(-1), ValueError, "-1"),
    ("block-shape-zero", lambda: P.block_shape(0), ValueError, "num_pages must be >= 1, got 0"),
    ("block-shape-fraction", lambda: P.block_shape(2.5), TypeError, "2.5"),
    ("block-shape-bool", lambda: P.block_shape(True), TypeError, "True"),
    ("block-shape-tokens-zero", lambda: P.block_shape(2, tokens_per_block=0), ValueError, "tokens_per_block"),
    ("scales-shape-unquantized", lambda: P.scales_shape(2), ValueError, "kvcache_quant_config"),
    ("scales-shape-tokens", lambda: Q.scales_shape(2, tokens_per_block=3), ValueError, "tokens_per_scale=2"),
    ("quant-config-dict", params(kvcache_quant_config={}), TypeError, "kvcache_quant_config"),
    ("quant-fp8-bare", params(dtype=DType.float8_e4m3fn), ValueError, "kvcache_quant_config"),
    ("quant-granularity-str", lambda: KVCacheQuantConfig(quantization_granularity="8"), TypeError, "'8'"),
    ("quant-tokens-bool", lambda: KVCacheQuantConfig(tokens_per_scale=True), TypeError, "True"),
    ("quant-scale-dtype", lambda: KVCacheQuantConfig(scale_dtype=DType.float16), ValueError, "scale_dtype"),
    ("multi-not-mapping", lambda: MultiKVCacheParams([P]), TypeError, "children"),
    ("multi-child", lambda: MultiKVCacheParams({"a": "p"}), TypeError, "'a'"),
)


@pytest.mark.parametrize("case", PARAMS_CASES)
def test_params_refuse(case: Case) -> None:
    raises_naming(case)


# ------------------------------------------------------------------ buffers


def block_tensor() -> Buffer:
    return Buffer.zeros(P.block_shape(3), DType.float32, device=CPU())


BUFFER_CASES = cases(
    ("values-numpy", lambda: KVCacheBuffer(False, [np.zeros((3, 4))]), TypeError, "values[0]"),
    ("values-none", lambda: KVCacheBuffer(False, None), TypeError, "None"),
    ("replicates-str", lambda: KVCacheBuffer("no", [block_tensor()]), TypeError, "'no'"),
    ("null-pages-fraction", lambda: KVCacheBuffer(False, [block_tensor()], num_null_pages=0.5), TypeError, "0.5"),
    ("null-pages-negative", lambda: KVCacheBuffer(False, [block_tensor()], num_null_pages=-1), ValueError, "-1"),
    ("null-pages-all", lambda: KVCacheBuffer(False, [block_tensor()], num_null_pages=3), ValueError, "3"),
    ("allocate-huge", lambda: KVCacheBuffer.allocate(P, HUGE, P.devices), ValueError, f"total_num_pages={HUGE}"),
    ("allocate-zero", lambda: KVCacheBuffer.allocate(P, 0, P.devices), ValueError, "0"),
    ("allocate-fraction", lambda: KVCacheBuffer.allocate(P, 2.5, P.devices), TypeError, "2.5"),
    ("allocate-device", lambda: KVCacheBuffer.allocate(P, 4, ["cpu"]), TypeError, "'cpu'"),
    ("allocate-params", lambda: KVCacheBuffer.allocate("P", 4, P.devices), TypeError, "str"),
    ("allocate-null-str", lambda: KVCacheBuffer.allocate(P, 4, P.devices, null_page="yes"), TypeError, "'yes'"),
)


@pytest.mark.parametrize("case", BUFFER_CASES)
def test_buffers_refuse(case: Case) -> None:
    raises_naming(case)


# ------------------------------------------------------------ paged manager

PAGE = 4
PREFIX = list(range(100, 112))  # three full pages, cached by `old`


def ctx(request_id: Any, tokens: Any) -> TextContext:
    return TextContext(request_id, np.asarray(tokens, np.int64))


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
    """Two replicas. Replica 0: `a` (ran a step; `step` would commit its blocks),
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


def second(rid: str, tokens: Any) -> TextContext:
    """Another context object under a live request id."""
    return ctx(rid, tokens)


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


# ------------------------------------------------------- continuous manager

SEQ = 16


@pytest.fixture(scope="module")
def session() -> InferenceSession:
    return InferenceSession(devices=[CPU()])


def continuous_world(session: InferenceSession) -> tuple[ContinuousBatchingKVCacheManager, dict[str, TextContext]]:
    """Slots: `a` (ran a step not yet recorded), `b`; `d` was released."""
    m = ContinuousBatchingKVCacheManager(P, 3, SEQ, 2, [CPU()], session)
    c = {"a": ctx("a", range(5)), "b": ctx("b", [7, 8]), "d": ctx("d", [1])}
    for rid in "abd":
        m.claim(rid)
        m.alloc(c[rid])
    m.step([[c["b"]]])
    m.release("d")
    c["a"].update(1)
    return m, c


def continuous_follow_up(m: ContinuousBatchingKVCacheManager, c: dict[str, TextContext]) -> list:
    m.step([[c["a"], c["b"]]])
    seen = [m.slot_of("a"), m.cache_length("a"), m.cache_length("b")]
    m.release("a")
    seen.append(m.claim("n"))
    seen += [[x.to_numpy().tolist() for x in device[1:3]] for device in m.fetch([m.slot_of("b"), m.slot_of("n")])]
    return seen


def slot(m: ContinuousBatchingKVCacheManager, rid: str) -> int:
    return m.slot_of(rid)


def increment(m: ContinuousBatchingKVCacheManager, offsets: Any, inputs: Any = None) -> Any:
    fetched = m.fetch([slot(m, "a"), slot(m, "b")]) if inputs is None else inputs
    return m.increment_cache_lengths(fetched, (None, offsets))


def u32(values: list[int], dtype: Any = np.uint32) -> Buffer:
    return Buffer.from_numpy(np.asarray(values, dtype))


CONTINUOUS_CASES = cases(
    ("claim-bool-id", lambda m, c: m.claim(True), TypeError, "True"),
    ("claim-twice", lambda m, c: m.claim("a"), ValueError, "'a'"),
    ("claim-no-replica", lambda m, c: m.claim("z", 1), ValueError, "replica_idx=1"),
    ("claim-float-replica", lambda m, c: m.claim("z", 0.0), TypeError, "0.0"),
    ("alloc-steps-zero", lambda m, c: m.alloc(c["b"], num_steps=0), ValueError, "0"),
    ("alloc-steps-fraction", lambda m, c: m.alloc(c["b"], num_steps=1.5), TypeError, "1.5"),
    ("alloc-steps-huge", lambda m, c: m.alloc(c["b"], num_steps=HUGE), ValueError, "max_seq_len=16"),
    ("alloc-released", lambda m, c: m.alloc(c["d"]), ValueError, "'d'"),
    ("alloc-other-tokens", lambda m, c: m.alloc(second("a", [9, 9])), ValueError, "'a'"),
    ("release-released", lambda m, c: m.release("d"), ValueError, "'d'"),
    ("step-batches", lambda m, c: m.step([[c["a"]], [c["b"]]]), ValueError, "got 2"),
    ("step-twice", lambda m, c: m.step([[c["a"], c["a"]]]), ValueError, "'a'"),
    ("step-unclaimed-after", lambda m, c: m.step([[c["a"], c["d"]]]), ValueError, "'d'"),
    ("step-too-long-after", lambda m, c: m.step([[c["a"], ctx("b", range(40))]]), ValueError, "'b'"),
    ("step-other-tokens", lambda m, c: m.step([[c["a"], second("b", [1])]]), ValueError, "'b'"),
    ("inputs-twice", lambda m, c: m.runtime_inputs([[c["b"], c["b"]]]), ValueError, "'b'"),
    ("inputs-unclaimed-after", lambda m, c: m.runtime_inputs([[c["a"], c["d"]]]), ValueError, "'d'"),
    ("inputs-not-a-list", lambda m, c: m.runtime_inputs(None), TypeError, "None"),
    ("fetch-twice", lambda m, c: m.fetch([slot(m, "a"), slot(m, "a")]), ValueError, "appears twice"),
    ("fetch-float", lambda m, c: m.fetch([0.0]), TypeError, "0.0"),
    ("fetch-bool", lambda m, c: m.fetch([True]), TypeError, "True"),
    ("fetch-empty", lambda m, c: m.fetch([]), ValueError, "at least one"),
    ("fetch-str", lambda m, c: m.fetch("01"), TypeError, "'01'"),
    ("fetch-unclaimed", lambda m, c: m.fetch([slot(m, "a"), 2]), ValueError, "sequence id 2"),
    ("increment-devices", lambda m, c: increment(m, u32([0, 1, 2]), inputs=[]), ValueError, "0 entries"),
    ("increment-offsets-dtype", lambda m, c: increment(m, u32([0, 1, 2], np.int32)), TypeError, "int32"),
    ("increment-offsets-length", lambda m, c: increment(m, u32([0, 1])), ValueError, "2 entries"),
    ("increment-offsets-decrease", lambda m, c: increment(m, u32([0, 3, 2])), ValueError, "[0, 3, 2]"),
    ("increment-past-max", lambda m, c: increment(m, u32([0, 30, 31])), ValueError, "max_seq_len=16"),
    ("block-shape-negative", lambda m, c: m.block_shape(-2), ValueError, "-2"),
)


@pytest.mark.parametrize("case", CONTINUOUS_CASES)
def test_continuous_manager_refuses_and_changes_nothing(case: Case, session: InferenceSession) -> None:
    m, c = continuous_world(session)
    twin, twin_c = continuous_world(session)
    before = continuous_snapshot(m)
    raises_naming(case, m, c)
    assert continuous_snapshot(m) == before
    assert continuous_follow_up(m, c) == continuous_follow_up(twin, twin_c)
    assert continuous_snapshot(m, identities=False) == continuous_snapshot(twin, identities=False)


def continuous(
    session: Any, params: Any = P, slots: Any = 3, seq: Any = SEQ, layers: Any = 2, devices: Any = None
) -> Callable[[], Any]:
    return lambda: ContinuousBatchingKVCacheManager(params, slots, seq, layers, devices or [CPU()], session)


CONTINUOUS_CONSTRUCTOR_CASES = [
    (
        "prefix-caching",
        {"params": KVCacheParams(**BASE, enable_prefix_caching=True)},
        ValueError,
        "enable_prefix_caching=True",
    ),
    ("device-count", {"devices": [CPU(), CPU()]}, ValueError, "devices has 2 entries"),
    ("device-mismatch", {"params": KVCacheParams(**BASE, devices=[DeviceRef.CPU(1)])}, ValueError, "devices[0]"),
    ("device-type", {"devices": ["cpu"]}, TypeError, "'cpu'"),
    (
        "replicas",
        {
            "params": KVCacheParams(**BASE, data_parallel_degree=2, devices=[DeviceRef.CPU()] * 2),
            "devices": [CPU(), CPU()],
        },
        ValueError,
        "data_parallel_degree=2",
    ),
    ("slots-huge", {"slots": HUGE}, ValueError, str(HUGE)),
    ("seq-huge", {"seq": 10**9}, ValueError, "max_seq_len=1000000000"),
    ("slots-bool", {"slots": True}, TypeError, "True"),
    ("seq-fraction", {"seq": 15.5}, TypeError, "15.5"),
    ("layers-disagree", {"layers": 3}, ValueError, "num_layers=3"),
    ("session-none", {"session": None}, TypeError, "None"),
]


@pytest.mark.parametrize(
    ("name", "kwargs", "error", "names"),
    CONTINUOUS_CONSTRUCTOR_CASES,
    ids=[row[0] for row in CONTINUOUS_CONSTRUCTOR_CASES],
)
def test_continuous_constructor_refuses(
    name: str, kwargs: dict, error: type, names: str, session: InferenceSession
) -> None:
    kwargs = {"session": session, **kwargs}
    raises_naming(Case(name, continuous(**kwargs), error, names))
    estimate_kwargs = {k: v for k, v in kwargs.items() if k != "session"}
    if name not in ("session-none", "slots-huge", "seq-huge"):  # the estimate needs no session and allocates nothing
        with pytest.raises(error, match=re.escape(names)):
            ContinuousBatchingKVCacheManager.estimated_memory_size(
                estimate_kwargs.get("params", P),
                estimate_kwargs.get("slots", 3),
                estimate_kwargs.get("seq", SEQ),
                estimate_kwargs.get("layers", 2),
                estimate_kwargs.get("devices", [CPU()]),
            )


# ----------------------------------------------------------- graph wrappers


def with_cache(use: Callable[[PagedCacheValues, list], Any]) -> Callable[[], Any]:
    """Builds a graph over one device's paged cache and calls `use` inside it."""

    def build() -> Any:
        cpu = DeviceRef.CPU()
        rows = TensorType(DType.float32, ["n", 2, 8], cpu)
        other = [
            TensorType(DType.uint32, ["b"], cpu),
            TensorType(DType.int32, ["b"], cpu),
            TensorType(DType.float32, ["n", 3, 8], cpu),
            TensorType(DType.float32, ["n", 2, 4], cpu),
            TensorType(DType.bfloat16, ["n", 2, 8], cpu),
        ]
        with Graph("bad", input_types=[*paged_input_types(P), rows, *other]) as graph:
            cache = PagedCacheValues.from_inputs(graph.inputs[:4])
            use(cache, [v.tensor for v in graph.inputs[4:]])

    return build


def _store(layer: Any = 0, k: int = 0, offsets: int = 1) -> Callable[[], Any]:
    return with_cache(lambda cache, t: store_kv(cache, layer, t[k], t[k], t[offsets]))


def _attend(q: int = 0, scale: Any = 0.1, window: Any = 0, layer: Any = 0) -> Callable[[], Any]:
    return with_cache(lambda cache, t: attention(cache, layer, t[q], t[1], scale, window))


GRAPH_CASES = cases(
    ("store-layer-bool", _store(layer=True), TypeError, "True"),
    ("store-layer-float", _store(layer=1.0), TypeError, "1.0"),
    ("store-layer-negative", _store(layer=-1), ValueError, "-1"),
    ("store-layer-past", _store(layer=2), ValueError, "layer_idx must be <= 1, got 2"),
    ("store-keys-heads", _store(k=3), ValueError, "3 heads"),
    ("store-keys-head-dim", _store(k=4), ValueError, "head_dim 4"),
    ("store-keys-dtype", _store(k=5), TypeError, "bfloat16"),
    ("store-offsets-dtype", _store(offsets=2), TypeError, "int32"),
    ("store-offsets-rank", _store(offsets=0), TypeError, "rank 1"),
    ("gather-kv-2", with_cache(lambda cache, t: gather_kv(cache, 0, 2, t[1], t[1])), ValueError, "kv_idx"),
    ("attention-scale-nan", _attend(scale=NAN), ValueError, "nan"),
    ("attention-scale-str", _attend(scale="0.1"), TypeError, "'0.1'"),
    ("attention-scale-zero", _attend(scale=0.0), ValueError, "0.0"),
    ("attention-window-negative", _attend(window=-1), ValueError, "-1"),
    ("attention-window-float", _attend(window=2.5), TypeError, "2.5"),
    ("attention-q-heads", _attend(q=3), ValueError, "3 heads"),
    ("attention-layer-str", _attend(layer="0"), TypeError, "'0'"),
    ("attention-head-dim", _attend(), ValueError, "head_dim to be a multiple of 16, the cache has 8"),
    ("from-inputs-count", with_cache(lambda cache, t: PagedCacheValues.from_inputs(t[:2])), ValueError, "got 2"),
    ("input-types-page", lambda: paged_input_types(P, page_size=0), ValueError, "page_size must be >= 1, got 0"),
    ("input-types-page-float", lambda: paged_input_types(P, page_size=1.5), TypeError, "1.5"),
)


@pytest.mark.parametrize("case", GRAPH_CASES)
def test_graph_wrappers_refuse(case: Case) -> None:
    raises_naming(case)
