"""Driving the GPU ops' kernels under the CPU emulator (`tests/gpu/emulator.mojo`).

The emulator binary is built once per kernel-source revision into the cache
directory (about 4 minutes on 2 cores, by the first test worker that needs it;
the other waits for it); so is, where there is a GPU, the binary that
runs the same warp steps on it (`GPU_STEPS_SOURCE`). Each call writes its arrays as raw files,
runs the binary on them and reads back what the op wrote: the kernels' own
code, run thread by thread on the CPU, so their index arithmetic, masking,
split-K and merge are checked against the numpy references on a machine
without a GPU.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from mokv.kernels import _source_digest, kernel_source_dir, mojo_compiler
from mokv.paths import precompiled_kernels_dir

HARNESS_DIR = Path(__file__).parents[1] / "gpu"
EMULATOR_SOURCE = HARNESS_DIR / "emulator.mojo"
GPU_STEPS_SOURCE = HARNESS_DIR / "warp_steps_on_gpu.mojo"
"""Runs the `warp` op's steps on a GPU instead (`tests/gpu/test_warp_emulation.py`)."""


def build_harness(source: Path = EMULATOR_SOURCE, accelerator: str | None = None) -> Path:
    """The harness binary built from `source` (by default the emulator) for the
    current kernel sources, built if missing; its device code for
    `accelerator` (say `sm_90a`) when given."""
    sources = kernel_source_dir()
    # Every harness source: the binaries share modules (call_files.mojo, warp_steps.mojo).
    harness = "".join(path.read_text() for path in sorted(HARNESS_DIR.glob("*.mojo")))
    # The compiler's path too: a binary finds Mojo's runtime libraries through the
    # venv that built it, so one built from another checkout's venv sharing this cache
    # fails to load once that venv is gone.
    text = _source_digest(sources) + source.name + harness + str(mojo_compiler())
    digest = hashlib.sha256(text.encode())
    target = ["--target-accelerator", accelerator] if accelerator else []
    digest.update(" ".join(target).encode())
    out = precompiled_kernels_dir() / f"{source.stem}-{digest.hexdigest()[:16]}" / source.stem
    if out.exists():
        return out
    # One harness build at a time, with a Mojo compile cache of its own, dropped after
    # it: the suite's other worker waits for the binary instead of compiling the same
    # sources beside it, and no MAX graph compiling in another process shares that
    # cache (in CI a build among them failed with a bare "No such file or directory").
    builds = precompiled_kernels_dir() / "harness-builds"
    builds.mkdir(parents=True, exist_ok=True)
    with open(builds / "lock", "w") as lock, tempfile.TemporaryDirectory(dir=builds) as own_cache:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if out.exists():
            return out
        out.parent.mkdir(parents=True, exist_ok=True)
        partial = out.with_name(f"{out.name}.{os.getpid()}")
        command = [
            mojo_compiler(),
            "build",
            *target,
            "-I",
            str(sources.parent),
            "-I",
            str(HARNESS_DIR),
            str(source),
            "-o",
            str(partial),
        ]
        # os.environ: the environment this process started with (see mokv.kernels).
        env = dict(os.environ, MODULAR_CACHE_DIR=own_cache)
        result = subprocess.run(command, capture_output=True, text=True, env=env, check=False)
        if result.returncode != 0:
            raise RuntimeError(f"building {source.name} failed ({' '.join(command)}):\n{result.stderr}")
        os.replace(partial, out)  # atomic: a run that does not take the lock never sees half a binary
    return out


@dataclass(frozen=True)
class Launch:
    """One kernel an emulated op launched (`mokv_kernels.gpu.block.Emulator`)."""

    name: str
    """`KernelT.NAME`."""
    min_blocks: int
    """`KernelT.MIN_BLOCKS`: the blocks per multiprocessor its registers are sized for."""
    grid_x: int
    grid_y: int
    """For attention: query tiles times splits (`work.attention_grid`)."""
    grid_z: int


@dataclass
class Emulator:
    """Runs one op per call in a fresh directory under `workdir`; `launches`
    are the kernels the last call launched, `launched` their names (only
    attention calls report them, others leave both empty)."""

    binary: Path
    workdir: Path
    calls: int = 0
    launches: list[Launch] = field(default_factory=list)

    @property
    def launched(self) -> list[str]:
        return [launch.name for launch in self.launches]

    def run(self, meta: dict[str, object], arrays: dict[str, np.ndarray], output: str) -> bytes:
        """Writes `meta.txt` and `<name>.bin` per array, runs the emulator and
        returns the raw bytes of its `<output>.bin`. Raises `RuntimeError`
        with the emulator's message when the op raised."""
        self.calls += 1
        call_dir = self.workdir / f"call{self.calls}"
        call_dir.mkdir()
        (call_dir / "meta.txt").write_text("".join(f"{k} {v}\n" for k, v in meta.items()))
        for name, array in arrays.items():
            np.ascontiguousarray(array).tofile(call_dir / f"{name}.bin")
        result = subprocess.run([str(self.binary), str(call_dir)], capture_output=True, text=True, check=False)
        if result.returncode != 0:
            raise RuntimeError(f"emulated {meta['op']} failed: {result.stdout}{result.stderr}")
        launched = call_dir / "launched.bin"
        lines = launched.read_text().splitlines() if launched.exists() else []
        self.launches = [_launch(line) for line in lines if line.strip()]
        return (call_dir / f"{output}.bin").read_bytes()


def _launch(line: str) -> Launch:
    name, *numbers = line.split()
    return Launch(name, *(int(n) for n in numbers))


def cache_meta(
    op: str,
    layout: str,
    dtype: str,
    blocks: np.ndarray,
    layer: int,
    multiprocessors: int = 1,
    tensor_cores: bool = True,
    prefill_kernel: str | None = "mma",
) -> dict:
    """The meta entries every call has: the op, the layout, the block tensor's
    shape, the emulated device (multiprocessors, whether it has tensor
    cores: without, the ops launch the kernels of GPUs that have none; with,
    it has Hopper's warpgroup MMA too), and `MOKV_PREFILL_KERNEL` (None:
    unset, the op's default)."""
    num_blocks, _, num_layers, block_len, n_kv_heads, head_dim = blocks.shape
    meta = {
        "op": op,
        "layout": layout,
        "dtype": dtype,
        "num_blocks": num_blocks,
        "num_layers": num_layers,
        "block_len": block_len,
        "n_kv_heads": n_kv_heads,
        "head_dim": head_dim,
        "layer": layer,
        "multiprocessors": multiprocessors,
        "tensor_cores": int(tensor_cores),
    }
    if prefill_kernel is not None:
        meta["prefill_kernel"] = prefill_kernel
    return meta


def float32_bits(value: float) -> int:
    """The bits of `value` as a float32, so it crosses to the emulator exactly."""
    return int(np.array(value, np.float32).view(np.uint32))
