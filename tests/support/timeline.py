"""Where the suite's time goes: a pytest plugin that records every test phase and every
graph compile, per xdist worker, and a report of them.

CI's budget is spent mostly on compiling graphs (each distinct graph costs MAX about 23 s
before its kernels, and SmolLM2's 2-3 minutes on two cores), so `--durations` alone does not
say which fixture compiled what. Record, then report::

    MOKV_TIMELINE=.cache/timeline .venv/bin/python -m pytest -n 2 --no-loadscope-reorder \\
        -p tests.support.timeline
    .venv/bin/python -m tests.support.timeline .cache/timeline

Each process (controller and workers) appends JSON lines to `<dir>/<worker>.jsonl`:
`{"worker", "test", "phase", "start", "seconds"}` per setup/call/teardown, and
`{"worker", "graph", "start", "seconds"}` per `InferenceSession.compile` (what `load`,
`load_all` and `GraphGroup.load` call; a hit in MAX's compile cache shows as a short one). Graphs that a
test compiles in a subprocess (`max serve`) are in that test's phases only.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import pytest

TIMELINE_VARIABLE = "MOKV_TIMELINE"
"""The folder the records go to; without it the plugin records nothing."""


def _worker() -> str:
    return os.environ.get("PYTEST_XDIST_WORKER", "main")


class Recorder:
    """Appends records to `<folder>/<worker>.jsonl`, opening it on the first."""

    def __init__(self, folder: Path) -> None:
        self.worker = _worker()
        self.path = folder / f"{self.worker}.jsonl"
        self._sink: IO[str] | None = None

    def record(self, entry: dict[str, Any]) -> None:
        if self._sink is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._sink = self.path.open("a", buffering=1)
        self._sink.write(json.dumps({"worker": self.worker, **entry}) + "\n")

    def close(self) -> None:
        if self._sink is not None:
            self._sink.close()


_recorder: Recorder | None = None
"""This process's recorder, when a timeline folder is set."""


def _graph_names(model: object) -> str:
    """A compiled model's name: its module's graphs' (a graph compiles with every graph
    of its module), or a path."""
    model = getattr(model, "module", model)
    if hasattr(model, "top_level_graph_names"):
        return ",".join(model.top_level_graph_names())
    return str(getattr(model, "name", model))


def timed_compiles(compile_fn: Callable[..., Any], recorder: Recorder) -> Callable[..., Any]:
    """`compile_fn` (an `InferenceSession` method) recording each call's model and time."""

    def compile_and_record(self: object, model: object, *args: Any, **kwargs: Any) -> Any:
        start = time.time()
        try:
            return compile_fn(self, model, *args, **kwargs)
        finally:
            recorder.record({"graph": _graph_names(model), "start": start, "seconds": time.time() - start})

    compile_and_record.__wrapped__ = compile_fn  # type: ignore[attr-defined]
    return compile_and_record


def pytest_configure(config: pytest.Config) -> None:
    """Times MAX's compiles in this process, when a timeline folder is set."""
    global _recorder
    if TIMELINE_VARIABLE not in os.environ:
        return
    from max.engine import InferenceSession

    _recorder = Recorder(Path(os.environ[TIMELINE_VARIABLE]))
    if not hasattr(InferenceSession.compile, "__wrapped__"):
        InferenceSession.compile = timed_compiles(InferenceSession.compile, _recorder)


def pytest_unconfigure(config: pytest.Config) -> None:
    if _recorder is not None:
        _recorder.close()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    yield
    if _recorder is not None:
        _recorder.record({"test": item.nodeid, "phase": call.when, "start": call.start, "seconds": call.duration})


# ---------------------------------------------------------------- the report


@dataclass
class Span:
    """What one worker spent on one test file (or folder) or one graph."""

    worker: str
    name: str
    start: float
    end: float
    seconds: float


def _unit(test: str) -> str:
    """A test's work unit as `make test` schedules them (`tests/conftest.py`)."""
    from tests.conftest import _work_unit

    return _work_unit(test)


def read_timeline(folder: Path) -> tuple[list[Span], list[Span]]:
    """The recorded work units and graph compiles, each list ordered by start, times from
    the first record."""
    entries = [json.loads(line) for path in sorted(folder.glob("*.jsonl")) for line in path.read_text().splitlines()]
    if not entries:
        raise ValueError(f"no timeline records in {folder}: run pytest with {TIMELINE_VARIABLE}={folder}")
    origin = min(e["start"] for e in entries)
    units: dict[tuple[str, str], Span] = {}
    graphs = []
    for e in entries:
        start, end = e["start"] - origin, e["start"] - origin + e["seconds"]
        if "graph" in e:
            graphs.append(Span(e["worker"], e["graph"], start, end, e["seconds"]))
            continue
        key = (e["worker"], _unit(e["test"]))
        span = units.setdefault(key, Span(e["worker"], key[1], start, end, 0.0))
        span.start, span.end = min(span.start, start), max(span.end, end)
        span.seconds += e["seconds"]
    return sorted(units.values(), key=lambda s: (s.worker, s.start)), sorted(graphs, key=lambda s: s.start)


def report(folder: Path, least_seconds: float = 10.0) -> str:
    """Per worker its work units in order, then every compile of at least `least_seconds`."""
    units, graphs = read_timeline(folder)
    lines = ["worker  start    end  seconds  unit"]
    busy: dict[str, float] = defaultdict(float)
    for s in units:
        busy[s.worker] = max(busy[s.worker], s.end)
        if s.seconds >= least_seconds:
            lines.append(f"{s.worker:6} {s.start:6.0f} {s.end:6.0f} {s.seconds:8.0f}  {s.name}")
    lines += [f"{worker} last finished at {end:.0f} s" for worker, end in sorted(busy.items())]
    compiled = [g for g in graphs if g.seconds >= least_seconds]
    lines.append(f"\n{len(graphs)} compiles, {sum(g.seconds for g in graphs):.0f} s; of at least {least_seconds:g} s:")
    lines += [f"{g.worker:6} {g.start:6.0f} {g.seconds:8.0f}  {g.name}" for g in compiled]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=report.__doc__)
    parser.add_argument("folder", type=Path)
    parser.add_argument("--least-seconds", type=float, default=10.0)
    args = parser.parse_args()
    print(report(args.folder, args.least_seconds))


if __name__ == "__main__":
    main()
