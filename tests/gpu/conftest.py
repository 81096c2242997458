"""Fixtures for the tests that run mokv on a GPU; each such module skips, with
a reason naming what it would run, where MAX sees no accelerator. The
emulator tests beside them need no GPU and always run (`emulator`)."""

from __future__ import annotations

import pytest
from max.driver import CPU, Accelerator, Device, accelerator_count
from max.engine import InferenceSession
from max.graph import DeviceRef

from tests.gpu.emulation import Emulator, build_emulator

HAS_GPU = accelerator_count() > 0


def needs_gpu(what: str) -> pytest.MarkDecorator:
    """Skips the module's tests without a GPU, saying what they would run."""
    return pytest.mark.skipif(not HAS_GPU, reason=f"no GPU on this machine: would run {what} on one")


@pytest.fixture(scope="session")
def gpu() -> Device:
    return Accelerator()


@pytest.fixture(scope="session")
def gpu_ref() -> DeviceRef:
    return DeviceRef.GPU()


@pytest.fixture(scope="session")
def gpu_session(gpu: Device) -> InferenceSession:
    """One session for every GPU graph; the CPU is in it for the host-side inputs."""
    return InferenceSession(devices=[CPU(), gpu])


@pytest.fixture(scope="session")
def emulator(tmp_path_factory) -> Emulator:
    """The CPU emulator of the GPU kernels, built once per kernel-source revision."""
    return Emulator(build_emulator(), tmp_path_factory.mktemp("emulator"))
