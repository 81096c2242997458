"""The benchmarks' timing: candidates take turns, and no candidate always runs first."""

from __future__ import annotations

from collections.abc import Callable

from mokv_examples.bench.timing import time_alternately, time_rounds


def _recorders(names: str, order: list[str]) -> dict[str, Callable[[], None]]:
    def call(name: str) -> Callable[[], None]:
        return lambda: order.append(name)

    return {name: call(name) for name in names}


def test_each_round_starts_one_call_later() -> None:
    order: list[str] = []
    times = time_rounds(_recorders("abc", order), rounds=4)
    assert order == list("abcbcacababc")
    assert set(times) == set("abc")
    assert all(seconds >= 0 for seconds in times.values())


def test_alternating_rounds_take_turns_after_one_warm_up_each() -> None:
    order: list[str] = []
    time_alternately(_recorders("ab", order), min_runs=3, budget_s=0.0)
    assert order[:2] == list("ab"), "one warm-up each, in order"
    rounds = [order[i : i + 2] for i in range(2, len(order), 2)]
    assert rounds == [list("ab"), list("ba"), list("ab")]
