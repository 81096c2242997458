"""Compiles the graphs a GPU run compiles, for a GPU target, on a machine with or without
a GPU: the GPU tests' families (`tests/support/graph_families.py`, and SmolLM2's in
`tests/support/smollm2.py`) and the KV-formats benchmark's graphs, each family as one
`GraphGroup`, as they compile on a GPU; the quick attention benchmark's graphs (mokv's and
MAX's) and the profile's float8 decode (`tools/gpu_profile.py`); and mokv inside MAX's own
pipeline (MAX's Llama on mokv's attention, kernels and manager), as `max warm-cache
--target` compiles it.

MAX's virtual device mode (`max.driver.set_virtual_device_*`, what `max serve --target`
uses) gives the process a GPU that compiles but never runs: a graph that a GPU would
refuse at compile time (a kernel that does not build for the target, an op placed on the
wrong device, a group MAX cannot compile together) fails here, before a run spends its
device minutes on it. Executing is left to the GPU: the models it returns refuse to run.

The Mojo kernels these compiles leave in `MODULAR_CACHE_DIR` serve a GPU machine too (MAX's
cache keys a compiled kernel by its contents, not by where its package lies):
`tools/gpu_warm_cache.sh` packs them for the GPU run to carry. The ops' host side is
compiled for this machine's processor, which enters its key, unless `--host-cpu` names an
LLVM CPU (`max.driver.set_virtual_cpu_target`): a process on another machine that names
the same one finds it (`tools/pin_host_cpu.sh`).

Usage: .venv/bin/python tools/compile_gpu_graphs.py [--target sm_90a] [--host-cpu NAME] [family ...]
(families: attention, store_gather, quantized, formats, bench, profile, smollm2, pipeline;
default all. What each took is in tests/gpu/README.md.)
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from max import driver

REPO = Path(__file__).resolve().parents[1]
FAMILIES = ("attention", "store_gather", "quantized", "formats", "bench", "profile", "smollm2", "pipeline")
PIPELINE_CASES = (("float32", "float32"), ("bfloat16", "bfloat16"), ("bfloat16", "float8_e4m3fn"))
"""The (weights, KV cache) formats MAX's pipeline on mokv compiles in: bfloat16 weights over
bfloat16 or float8 pages are what a GPU serves (mokv's tensor-core kernels)."""


def _enter_virtual_device_mode(target: str, host_cpu: str) -> None:
    """One virtual GPU of `target` for this process, its host side compiled for `host_cpu`
    if named; before any device is created."""
    if host_cpu:
        driver.set_virtual_cpu_target(host_cpu)
    driver.set_virtual_device_api("cuda")
    driver.set_virtual_device_target_arch(target)
    driver.set_virtual_device_count(1)


def _warm_max_pipeline(model: Path, target: str, weights: str, kv_format: str) -> None:
    """MAX's `max warm-cache --target` over mokv's architecture (a process of its own,
    which enters virtual device mode itself): MAX's Llama graph with mokv's ops compiled
    for `target`, the model directory's `weights`, a `kv_format` cache; mokv's manager is
    the compile-only one there (`mokv.pipelines.compile_only`)."""
    from mokv_examples.max_model import weights_file
    from mokv_examples.max_server import MOKV_ARCHITECTURE, max_environment, max_executable

    command = [
        max_executable(), "warm-cache", "--target", f"cuda:{target}", "--devices", "gpu",
        "--model-path", str(model), "--weight-path", str(model / weights_file(weights)),
        "--quantization-encoding", weights, "--custom-architectures", MOKV_ARCHITECTURE,
        "--kv-cache-page-size", "16", "--kv-cache-format", kv_format,
    ]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, env=max_environment(), check=False)
    case = f"{weights} weights over a {kv_format} cache"
    if result.returncode != 0:
        raise RuntimeError(f"max warm-cache, {case}, failed:\n{result.stderr[-4000:]}")
    print(f"pipeline: MAX's Llama on mokv, {case}, compiled for {target}", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="sm_90a", help="the GPU architecture to compile for (default sm_90a)")
    parser.add_argument(
        "--host-cpu",
        default="",
        help="an LLVM CPU to compile the ops' host side for, e.g. x86-64-v3 (default: the process's)",
    )
    parser.add_argument("families", nargs="*", metavar="family", help=f"any of {', '.join(FAMILIES)} (default: all)")
    args = parser.parse_args(argv)
    unknown = [name for name in args.families if name not in FAMILIES]
    if unknown:
        parser.error(f"unknown families {unknown}: choose from {', '.join(FAMILIES)}")
    _enter_virtual_device_mode(args.target, args.host_cpu)
    sys.path[:0] = [str(REPO), str(REPO / "tools")]  # the tests' graph builders, the profile's cases

    from gpu_profile import profiled_formats
    from max.driver import CPU, Accelerator
    from max.engine import InferenceSession
    from max.graph import DeviceRef

    from mokv.graph import GraphGroup
    from mokv.kernels import kernel_package
    from mokv_examples.bench.attention_cases import gpu_quick_cases
    from mokv_examples.bench.attention_kernels import Kernels
    from mokv_examples.bench.kv_formats import FORMATS, FormatKernels
    from mokv_examples.max_model import ensure_model_dir
    from mokv_models.gguf_model import load_llama
    from tests.support import graph_families
    from tests.support.compile_once import compiled_together
    from tests.support.smollm2 import dense_and_paged_graphs

    gpu = Accelerator()
    session = InferenceSession(devices=[CPU(), gpu])
    kernels = kernel_package()
    device = DeviceRef.GPU()

    def family_group(family: graph_families.GraphFamily) -> Callable[[], int]:
        def compile_family() -> int:
            compiled_together(session, family.build, family.keys)(*family.keys[0])  # compiles them all
            return len(family.keys)

        return compile_family

    def formats() -> int:
        format_kernels = FormatKernels(Kernels(session, kernels, gpu))
        format_kernels[FORMATS[0]]  # compiles them all
        return 2 * len(format_kernels.models)

    def bench() -> int:
        bench_kernels = Kernels(session, kernels, gpu)
        cases = gpu_quick_cases()
        for dtype in dict.fromkeys(case.dtype for case in cases):
            bench_kernels.mokv_model(dtype)
        for case in cases:
            bench_kernels.max_kernel(case)
        return len(bench_kernels.mokv) + len(bench_kernels.max)

    def profile() -> int:
        chosen = profiled_formats()
        for kv_format in chosen:  # a group of its own each, as the profile's
            FormatKernels(Kernels(session, kernels, gpu), (kv_format,))[kv_format]
        return 2 * len(chosen)

    def smollm2() -> int:
        group = GraphGroup()
        dense_and_paged_graphs(load_llama(weights="f32"), group, device)
        return len(group.load(session))

    def pipeline() -> int:
        model = ensure_model_dir(*dict.fromkeys(weights for weights, _ in PIPELINE_CASES))
        for weights, kv_format in PIPELINE_CASES:
            _warm_max_pipeline(model, args.target, weights, kv_format)
        return len(PIPELINE_CASES)

    compiles = {
        "attention": family_group(graph_families.attention_family(kernels, device)),
        "store_gather": family_group(graph_families.store_gather_family(kernels, device)),
        "quantized": family_group(graph_families.quantized_family(kernels, device)),
        "formats": formats,
        "bench": bench,
        "profile": profile,
        "smollm2": smollm2,
        "pipeline": pipeline,
    }
    for name in args.families or FAMILIES:
        print(f"{name}: compiling for {args.target} ...", flush=True)
        started = time.perf_counter()
        count = compiles[name]()
        print(f"{name}: {count} graphs compiled in {time.perf_counter() - started:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    status = main()
    # Out without the interpreter's teardown: in virtual device mode MAX's runtime has
    # aborted at exit now and then ("terminate called without an active exception", after
    # every compile had finished), which would fail a run that did all its work.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
