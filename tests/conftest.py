"""Session-wide fixtures: one inference session and one precompiled kernel package
per test run, and mokv's caches (MAX's compiled graphs among them) kept inside the
checkout, as under make, so warm runs are fast however pytest is started."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from max.driver import CPU
from max.engine import InferenceSession

from mokv.kernels import kernel_package
from mokv.paths import CACHE_ENV, keep_compiled_graphs_in_cache_dir
from tests.attention_graph import build_attention_graph
from tests.compile_once import compiled_per_key

REPO = Path(__file__).resolve().parents[1]
os.environ.setdefault(CACHE_ENV, str(REPO / ".cache"))
keep_compiled_graphs_in_cache_dir()


@pytest.fixture(scope="session")
def session() -> InferenceSession:
    """The one CPU inference session every compiled test graph is loaded into."""
    return InferenceSession(devices=[CPU()])


@pytest.fixture(scope="session")
def kernels() -> Path:
    """mokv's Mojo kernels, precompiled once per source revision."""
    return kernel_package()


@pytest.fixture(scope="session")
def attention_graph(session: InferenceSession, kernels: Path):
    """`get(layout, dtype)`: the attention graph, compiled once per session on first use."""
    return compiled_per_key(session, lambda layout, dtype: build_attention_graph(layout, dtype, kernels))
