"""What the KV cache costs inside a step of `mokv bench e2e`, for the cache's share of step
time: the manager's calls (`TimedManager`) plus the graph's store and attention ops, the latter
measured as the step's time minus that of the same graph with attention skipped
(`SkipAttention`), run on the same inputs right after every step (`CacheCost`)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
from max.driver import Buffer
from max.engine import Model
from max.graph import BufferType, TensorType, TensorValue, Value

from mokv_examples.pipeline import SmolLM2
from mokv_examples.scheduler import CacheInputs, Scheduler
from mokv_models.llama import last_token_rows


class SkipAttention:
    """An attention backend that costs nothing (it returns the queries): the same
    graph without the cache, to time what the cache's ops cost in a step."""

    custom_extensions: tuple[Path, ...] = ()

    def input_types(self) -> list[TensorType | BufferType]:
        return []

    def __call__(
        self,
        layer_idx: int,
        q: TensorValue,
        k: TensorValue,
        v: TensorValue,
        input_row_offsets: TensorValue,
        graph_inputs: Sequence[Value],
    ) -> TensorValue:
        return q


class TimedManager:
    """Forwards every call to a cache manager, adding up the seconds spent in them."""

    def __init__(self, manager: Any) -> None:
        self._manager = manager
        self.seconds = 0.0

    def __getattr__(self, name: str) -> Any:
        attribute = getattr(self._manager, name)
        if not callable(attribute):
            return attribute

        def timed(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return attribute(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - started

        return timed


class CacheCost:
    """Times a pipeline's steps and, after each one, the cache-free graph on the same
    inputs (outside the scheduler's step timing, which stays the model's alone)."""

    def __init__(self, model: SmolLM2, without_cache: Model) -> None:
        self.model = model
        self.without_cache = without_cache
        self.step_seconds = 0.0
        self.skipped_seconds = 0.0
        self._last: list[Buffer] = []

    def step(
        self,
        tokens: npt.NDArray[np.int64],
        row_offsets: npt.NDArray[np.uint32],
        positions: npt.NDArray[np.int64],
        cache: CacheInputs,
    ) -> npt.NDArray[np.float32]:
        self._last = [Buffer.from_numpy(a) for a in (tokens, row_offsets, positions, last_token_rows(row_offsets))]
        started = time.perf_counter()
        logits = self.model.step(tokens, row_offsets, positions, cache)
        self.step_seconds += time.perf_counter() - started
        return logits

    def after_step(self, scheduler: Scheduler) -> None:
        started = time.perf_counter()
        self.without_cache.execute(*self._last)
        self.skipped_seconds += time.perf_counter() - started

    def share(self, manager_seconds: float) -> float:
        """The cache's share of step time: manager calls plus store and attention ops."""
        cache_ops = max(0.0, self.step_seconds - self.skipped_seconds)
        return (manager_seconds + cache_ops) / (self.step_seconds + manager_seconds)
