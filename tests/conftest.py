"""Session-wide fixtures: one inference session and one precompiled kernel package
per test run, and MAX's compile cache kept inside the checkout so warm runs are fast."""

from __future__ import annotations

import os
from pathlib import Path

_REPO = Path(__file__).resolve().parents[1]
os.environ.setdefault("MODULAR_CACHE_DIR", str(_REPO / ".cache" / "modular"))

import pytest
from max.driver import CPU
from max.dtype import DType
from max.engine import InferenceSession, Model

from mokv.kernels import kernel_package
from tests.attention_graph import build_attention_graph


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
    """One compiled graph per (layout, dtype) for the whole session, built on first use."""
    models: dict[tuple[str, DType], Model] = {}

    def get(layout: str, dtype: DType) -> Model:
        if (layout, dtype) not in models:
            models[layout, dtype] = session.load(build_attention_graph(layout, dtype, kernels))
        return models[layout, dtype]

    return get
