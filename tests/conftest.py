"""Session-wide fixtures: one inference session and one precompiled kernel package
per test run, and MAX's compile cache kept inside the checkout so warm runs are fast."""

from __future__ import annotations

import os
from pathlib import Path

_REPO = Path(__file__).resolve().parents[1]
os.environ.setdefault("MODULAR_CACHE_DIR", str(_REPO / ".cache" / "modular"))

import pytest  # noqa: E402
from max.driver import CPU  # noqa: E402
from max.engine import InferenceSession  # noqa: E402

from mokv.kernels import kernel_package  # noqa: E402


@pytest.fixture(scope="session")
def session() -> InferenceSession:
    """The one CPU inference session every compiled test graph is loaded into."""
    return InferenceSession(devices=[CPU()])


@pytest.fixture(scope="session")
def kernels() -> Path:
    """mokv's Mojo kernels, precompiled once per source revision."""
    return kernel_package()
