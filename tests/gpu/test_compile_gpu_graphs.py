"""The GPU graphs compile for Hopper on any machine (`tools/compile_gpu_graphs.py`, MAX's
virtual device mode): the attention family, compiled together as the GPU tests compile it,
so a graph a GPU would refuse to compile fails here, in CI, before a GPU run. The GPU proof
leaves this file out: on a GPU the tests compile the same graphs for real."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TOOL = REPO / "tools" / "compile_gpu_graphs.py"


def test_the_attention_family_compiles_for_hopper_without_a_gpu():
    # A process of its own: virtual device mode must be entered before any device exists.
    # os.environ: the environment this process started with (MAX's bindings change the
    # C-level one, which would send the child to another Python: see mokv.kernels).
    command = [sys.executable, str(TOOL), "--target", "sm_90a", "attention"]
    result = subprocess.run(command, capture_output=True, text=True, env=dict(os.environ), timeout=1200, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "attention: 4 graphs compiled in" in result.stdout


def test_an_unknown_family_is_refused_by_name(capsys):
    spec = importlib.util.spec_from_file_location("compile_gpu_graphs", TOOL)
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    with pytest.raises(SystemExit) as exited:
        tool.main(["attention", "prefil"])
    assert exited.value.code == 2
    assert "unknown families ['prefil']" in capsys.readouterr().err
