"""The suite timeline (`tests.support.timeline`): what a pytest run under it records, and
the report read back from those records."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from max.dtype import DType
from max.graph import DeviceRef, TensorType

from mokv.graph import GraphGroup
from tests.support import timeline

REPO = Path(__file__).resolve().parents[1]


def test_a_run_records_each_phase_and_the_report_sums_them(tmp_path):
    tests = tmp_path / "test_sleepy.py"
    tests.write_text("import time\n\ndef test_sleeps():\n    time.sleep(0.3)\n\ndef test_quick():\n    pass\n")
    records = tmp_path / "timeline"
    # Run as a plain pytest, not as one of this run's xdist workers.
    without_worker = {k: v for k, v in os.environ.items() if k != "PYTEST_XDIST_WORKER"}
    run = subprocess.run(
        [
            *(sys.executable, "-m", "pytest", "-q", "-p", "tests.support.timeline", "-p", "no:cacheprovider"),
            *("--rootdir", str(tmp_path), str(tests)),  # test ids relative to tmp_path wherever the checkout is
        ],
        cwd=REPO,
        env={**without_worker, timeline.TIMELINE_VARIABLE: str(records)},
        capture_output=True,
        text=True,
        check=False,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    entries = [json.loads(line) for line in (records / "main.jsonl").read_text().splitlines()]
    phases = {(e["test"].split("::")[1], e["phase"]): e["seconds"] for e in entries}
    assert set(phases) == {(t, p) for t in ("test_sleeps", "test_quick") for p in ("setup", "call", "teardown")}
    assert 0.3 <= phases["test_sleeps", "call"] < 5 and phases["test_quick", "call"] < 0.3

    (unit,), graphs = timeline.read_timeline(records)
    assert unit.name == tests.name and graphs == []
    assert unit.seconds == pytest.approx(sum(phases.values()))
    assert f"{unit.seconds:8.0f}  {tests.name}" in timeline.report(records, least_seconds=0)


def test_a_compile_is_recorded_with_its_graphs_names(tmp_path):
    """A graph of a `GraphGroup` compiles its whole module: the record names every graph."""
    recorder = timeline.Recorder(tmp_path)
    group = GraphGroup()
    for name in ("encoder", "decoder"):
        with group.graph(name, [TensorType(DType.float32, [2], DeviceRef.CPU())]) as graph:
            graph.output(graph.inputs[0].tensor)

    def compile_slowly(session, model):
        time.sleep(0.2)
        return "compiled"

    assert timeline.timed_compiles(compile_slowly, recorder)(None, graph) == "compiled"
    recorder.close()
    (entry,) = [json.loads(line) for line in recorder.path.read_text().splitlines()]
    assert entry["graph"] == "encoder,decoder" and 0.2 <= entry["seconds"] < 5
    _, (graph,) = timeline.read_timeline(tmp_path)
    assert graph.name == "encoder,decoder" and graph.end - graph.start == pytest.approx(entry["seconds"])
