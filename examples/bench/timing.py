"""How the benchmarks time what they compare: the candidates take turns call by call, so load
from other processes on a shared machine hits all of them alike and only their ratios are
read; and the memory yardsticks (a large copy on the host or on the GPU) that a kernel's read
rate is set against, measured next to each case."""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
from max.driver import Buffer, Device
from max.dtype import DType


def _one_round(calls: Mapping[str, Callable[[], Any]], times: dict[str, list[float]], first: int = 0) -> None:
    """Runs each call once, in order from the `first`-th (then around), adding its seconds to
    `times`. Rounds that start at each call in turn leave no call always first or always after
    the same one: the tenth GPU run timed one and the same kernel 17% slower in the first place
    of every round than in a later one (a 2k prefill, `docs/gpu-runs.md`)."""
    names = list(calls)
    for name in names[first % len(names) :] + names[: first % len(names)]:
        started = time.perf_counter()
        calls[name]()
        times[name].append(time.perf_counter() - started)


def time_rounds(calls: Mapping[str, Callable[[], Any]], rounds: int) -> dict[str, float]:
    """Median seconds per call of each callable over exactly `rounds` rounds, the callables
    taking turns, each round starting one call later (no warm-up: the caller has run each
    already)."""
    times: dict[str, list[float]] = {name: [] for name in calls}
    for r in range(rounds):
        _one_round(calls, times, r)
    return {name: statistics.median(t) for name, t in times.items()}


def time_alternately(
    calls: Mapping[str, Callable[[], Any]], min_runs: int, budget_s: float, max_runs: int = 50
) -> dict[str, float]:
    """Median seconds per call of each callable, run in turn (each round starting one call
    later) after one warm-up each, at least `min_runs` rounds (3 when the warm-up alone
    outlasts `budget_s`: some reference kernels take seconds per call) and until `budget_s`
    is spent, at most `max_runs` rounds."""
    started = time.perf_counter()
    for call in calls.values():
        call()
    if time.perf_counter() - started > budget_s:
        min_runs = min(min_runs, 3)
    times: dict[str, list[float]] = {name: [] for name in calls}
    started = time.perf_counter()
    rounds = 0
    while rounds < min_runs or (time.perf_counter() - started < budget_s and rounds < max_runs):
        _one_round(calls, times, rounds)
        rounds += 1
    return {name: statistics.median(t) for name, t in times.items()}


class CopyProbe:
    """The host's memory yardstick: `np.copyto` between two 1 GiB float32 arrays, kept for the
    whole run and measured again next to every case."""

    def __init__(self) -> None:
        self.src = np.ones(1 << 28, np.float32)
        self.dst = np.empty_like(self.src)
        np.copyto(self.dst, self.src)

    def gbps(self, runs: int = 3) -> float:
        """Bytes read per second (median of `runs` copies), in GB/s."""
        seconds = time_rounds({"copy": lambda: np.copyto(self.dst, self.src)}, runs)["copy"]
        return self.src.nbytes / seconds / 1e9


class GpuCopyProbe:
    """The GPU's memory yardstick: a 1 GiB device-to-device copy, whose read plus write
    traffic per second stands for the achievable HBM bandwidth."""

    def __init__(self, device: Device) -> None:
        self.device = device
        self.src = Buffer(DType.uint8, [1 << 30], device=device)
        self.dst = Buffer(DType.uint8, [1 << 30], device=device)
        self.dst.inplace_copy_from(self.src)
        device.synchronize()

    def _copy(self) -> None:
        self.dst.inplace_copy_from(self.src)
        self.device.synchronize()

    def gbps(self, runs: int = 5) -> float:
        """Bytes moved (read + written) per second, median of `runs`, in GB/s."""
        return 2 * self.src.num_elements / time_rounds({"copy": self._copy}, runs)["copy"] / 1e9


def with_variable(name: str, value: str, call: Callable[[], Any]) -> Callable[[], Any]:
    """`call` with the environment variable `name` set to `value` (mokv's
    GPU op reads `MOKV_PREFILL_KERNEL`, `MOKV_DECODE_KERNEL` and
    `MOKV_ATTENTION_SPLITS` at every call), then set back."""

    def run() -> Any:
        before = os.environ.get(name)
        os.environ[name] = value
        try:
            return call()
        finally:
            if before is None:
                del os.environ[name]
            else:
                os.environ[name] = before

    return run
