"""Fixtures for the tests that run mokv on a GPU; each such module skips, with
a reason naming what it would run, where MAX sees no accelerator. The
emulator tests beside them need no GPU and always run (`emulator`)."""

from __future__ import annotations

import pytest
from max.driver import CPU, Accelerator, Device
from max.engine import InferenceSession
from max.graph import DeviceRef

from tests.support.emulation import Emulator, build_harness


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
    return Emulator(build_harness(), tmp_path_factory.mktemp("emulator"))
