"""Session-wide fixtures: one inference session and one precompiled kernel package
per test run, and mokv's caches (MAX's compiled graphs among them) kept inside the
checkout, as under make, so warm runs are fast however pytest is started."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings
from max.driver import CPU
from max.engine import InferenceSession
from max.graph import DeviceRef

from mokv.kernels import kernel_package
from mokv.paths import CACHE_ENV, keep_compiled_graphs_in_cache_dir
from tests.support import property_stats
from tests.support.compile_once import compiled_together
from tests.support.graph_families import attention_family, store_gather_family

REPO = Path(__file__).resolve().parents[1]
os.environ.setdefault(CACHE_ENV, str(REPO / ".cache"))
keep_compiled_graphs_in_cache_dir()


def pytest_configure(config: pytest.Config) -> None:
    """Where xdist starts workers, before it starts them: MAX's own KV cache ops (the
    reference the GPU tests import) imported once in a child process, which compiles
    them into the venv on first import. Two workers importing them at once in a fresh
    venv raced to write that library, and one read it half written ("file too short": a
    clean clone's `.ci/run`, 2026-11-28). A child, because importing them here would
    leave this process's environment such that the workers it starts lose the venv."""
    if config.getoption("numprocesses", None) and not hasattr(config, "workerinput"):
        subprocess.run([sys.executable, "-c", "import max._kv_cache_ops"], check=True)


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
    """`get(layout, dtype)`: the attention graph; the family compiled together on first use."""
    family = attention_family(kernels, DeviceRef.CPU())
    return compiled_together(session, family.build, family.keys)


@pytest.fixture(scope="session")
def store_gather(session: InferenceSession, kernels: Path):
    """`get(layout, dtype)`: the store-then-gather graph; the family compiled together on
    first use (the store/gather and tier tests share it)."""
    family = store_gather_family(kernels, DeviceRef.CPU())
    return compiled_together(session, family.build, family.keys)


# Property tests (hypothesis): a bounded profile for CI and a long one for soaking,
# chosen with MOKV_HYPOTHESIS_PROFILE=soak. Derandomized in CI so a run is repeatable.
settings.register_profile(
    "ci",
    max_examples=150,
    stateful_step_count=40,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile(
    "soak",
    max_examples=3000,
    stateful_step_count=120,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
HYPOTHESIS_PROFILE = os.environ.get("MOKV_HYPOTHESIS_PROFILE", "ci")
settings.load_profile(HYPOTHESIS_PROFILE)

# `make test` runs two pytest-xdist workers (`-n 2 --no-loadscope-reorder`): the suite's
# long stretches are single-threaded compiles, so CI's two cores run two at once.
WHOLE_FOLDERS = ("pipelines", "model", "gpu")
"""Test folders whose session fixtures compile large graphs or start servers (MAX's
pipelines and `max serve`, SmolLM2's graphs, the GPU emulator): each runs whole in one
worker, so nothing is compiled or started twice, and first, so the longest start together.
Every other test file is a work unit of its own."""


def _work_unit(nodeid: str) -> str:
    """The folder of `WHOLE_FOLDERS` a test is in, else its file."""
    path = Path(nodeid.split("::", 1)[0])
    inside = path.parts[1:] if path.parts[0] == "tests" else path.parts
    return inside[0] if len(inside) > 1 and inside[0] in WHOLE_FOLDERS else str(path)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object | None:
    """Under xdist's default `--dist load`, its scope scheduling with `_work_unit` as the
    scope (its `xdist_group` marks do not reach pytest 9's node ids); any `--dist` asked
    for by name (the GPU proof's `loadfile`) is left to xdist. Optional, as is the other
    xdist hook here: where xdist is not loaded, pytest must not reject them."""
    if config.getoption("dist") != "load":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class FolderScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _work_unit(nodeid)

    return FolderScheduling(config, log)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Where xdist is installed, the whole folders first, in `WHOLE_FOLDERS`' order (the rest
    as collected): its workers must all collect in this order, and they run without `-n`."""
    if config.pluginmanager.hasplugin("xdist"):
        first = {folder: rank for rank, folder in enumerate(WHOLE_FOLDERS)}
        items.sort(key=lambda item: first.get(_work_unit(item.nodeid), len(first)))


def pytest_sessionfinish(session: pytest.Session) -> None:
    """An xdist worker hands its property-test counts to the controller (`pytest_testnodedown`)."""
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:
        workeroutput["property_stats"] = (dict(property_stats.CASES), dict(property_stats.OPERATIONS))


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: object, error: object) -> None:
    """On the xdist controller: a finished worker's property-test counts, added to this process's."""
    cases, operations = getattr(node, "workeroutput", {}).get("property_stats", ({}, {}))
    property_stats.CASES.update(cases)
    property_stats.OPERATIONS.update(operations)


def pytest_terminal_summary(terminalreporter) -> None:
    """How many generated cases and operations the property tests ran."""
    lines = property_stats.summary()
    if lines:
        terminalreporter.section(f"property tests (profile {HYPOTHESIS_PROFILE})")
        for line in lines:
            terminalreporter.write_line(line)
