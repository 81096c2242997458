"""ContinuousBatchingKVCacheManager refuses bad calls and changes nothing.

As for the paged manager (`tests/paged/test_bad_inputs.py`): each refused call
names the bad value, leaves the manager's observable state as it was
(`continuous_snapshot`), and a twin that never saw it behaves the same after.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from max.driver import CPU, Buffer
from max.engine import InferenceSession
from max.graph import DeviceRef

from mokv import ContinuousBatchingKVCacheManager, KVCacheParams, TextContext
from tests.support.manager_state import continuous_snapshot
from tests.support.refusals import BASE, HUGE, Case, P, cases, ctx, raises_naming, second

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
