"""Runs mokv's GPU attention on a few of `mokv bench attention --device gpu`'s
cases, each call twice, for a profiler to watch (`tools/gpu_proof.sh
--profile` runs it under Nsight Compute): the first call of a case warms it
up, the second is the one to read. No MAX kernel runs here, so every kernel
the profiler sees is mokv's (attention, and the split-K merge where the plan
splits the context). On a Hopper GPU a bfloat16 prefill case runs with
`MOKV_PREFILL_KERNEL=wgmma`, then each warpgroup variant the benchmark times
(`=wgmma_producer` and `=wgmma_tma`, or those `MOKV_BENCH_PREFILL_VARIANTS` names), so
those warpgroup prefill kernels are in the report (the ninth run's profile has `mma.sync`'s).
A bfloat16 decode case runs again with each `MOKV_DECODE_KERNEL` variant its KV heads take
(`=warp_heads`, decode blocks of four KV heads, one a warp; `=warp_heads_8`, eight), so
their memory charts stand beside the default decode's.

A case named `NAME:FORMAT` is a KV-formats case (`--only-kv-formats`, say
`decode-32x8x128-page128-b16-ctx8192:float8_e4m3fn`): that format's decode
only, its cache filled by its own store first (the store's kernels run
before the profiled decode calls, once).

Usage: python3 tools/gpu_profile.py [CASE ...]  (names as in the benchmark;
default: the 32-sequence decode, the 2k prefill and the float8 decode at
batch 16 / 8k)."""

from __future__ import annotations

import os
import sys

import numpy as np
from max.driver import CPU, Accelerator
from max.engine import InferenceSession

from mokv_examples.bench.attention import (
    ALL_PREFILL_VARIANTS,
    PREFILL_KERNEL,
    PREFILL_VARIANTS_VARIABLE,
    chosen_variants,
    has_warpgroup_mma,
    with_variable,
)
from mokv_examples.bench.attention_cases import gpu_quick_cases, make_inputs
from mokv_examples.bench.attention_kernels import DECODE_KERNEL, Kernels, decode_variants
from mokv_examples.bench.kv_formats import FormatKernels, format_calls, format_cases

DEFAULT_CASES = (
    "decode-bfloat16-32x8x128-page128-b32-ctx4096",
    "prefill-bfloat16-32x8x128-page128-b1-ctx2048-new2048",
    "decode-32x8x128-page128-b16-ctx8192:float8_e4m3fn",
)


def profiled_formats(names: list[str] | None = None) -> tuple[str, ...]:
    """The KV formats whose decode the profile runs (`NAME:FORMAT` cases), in order."""
    return tuple(dict.fromkeys(name.split(":")[1] for name in names or DEFAULT_CASES if ":" in name))


def profile_format_case(name: str, kv_format: str, kernels: Kernels) -> None:
    """A KV-formats case's decode over `kv_format`'s cache, twice."""
    cases = {case.name: case for case in format_cases(quick=True, gpu=True)}
    decode = format_calls(cases[name], FormatKernels(kernels, (kv_format,)))[kv_format].decode
    for _ in range(2):
        decode()
    print(f"ran {name} over {kv_format} twice", flush=True)


def warpgroup_variants() -> list[str]:
    """The warpgroup prefill variants the benchmark times, as
    `MOKV_BENCH_PREFILL_VARIANTS` names them (all, unset): a variant left
    out of the benchmark (one that hung in the tests) stays out of the
    profile too."""
    names = os.environ.get(PREFILL_VARIANTS_VARIABLE, ALL_PREFILL_VARIANTS)
    return [v.kernel for v in chosen_variants(names) if v.kernel != "mma"]


def main(names: list[str]) -> None:
    gpu = Accelerator()
    kernels = Kernels(InferenceSession(devices=[CPU(), gpu]), device=gpu)
    cases = {case.name: case for case in gpu_quick_cases()}
    for name in names or DEFAULT_CASES:
        if ":" in name:
            profile_format_case(*name.split(":"), kernels)
            continue
        case = cases[name]
        model = kernels.mokv_model(case.dtype)
        args = make_inputs(case, np.random.default_rng(0), (case.dtype,), gpu)[case.dtype].mokv_args(case.softmax_scale)
        kinds = ["wgmma", *warpgroup_variants()] if case.phase == "prefill" and has_warpgroup_mma(kernels) else ["mma"]
        runs = [(PREFILL_KERNEL, kind, f"{kind} prefill products") for kind in kinds]
        if case.phase == "decode":
            runs += [
                (DECODE_KERNEL, d.kernel, f"decode with {d.label}")
                for d in decode_variants(kernels, case.heads, case.dtype)
            ]
        for variable, value, what in runs:
            call = with_variable(variable, value, lambda model=model, args=args: model.execute(*args))
            for _ in range(2):
                call()
                gpu.synchronize()
            print(f"ran {name} twice ({what})", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
