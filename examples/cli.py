"""The `mokv` command line: one click group, each pipeline in its own module."""

from __future__ import annotations

import os

from mokv.kernels import cache_dir

# Compiled graphs are cached beside the precompiled kernels (the checkout's
# .cache/ unless MOKV_CACHE_DIR says otherwise), as under `make`, so every way
# of running `mokv` reuses them. Set before MAX is imported.
os.environ.setdefault("MODULAR_CACHE_DIR", str(cache_dir() / "modular"))

import click

from mokv_examples.bench_attention import attention as bench_attention
from mokv_examples.bench_e2e import e2e as bench_e2e
from mokv_examples.bench_kernels import kernels as bench_kernels
from mokv_examples.bench_manager import manager as bench_manager
from mokv_examples.bench_soak import soak as bench_soak
from mokv_examples.chat import chat
from mokv_examples.generate import generate
from mokv_examples.inspect_cache import inspect_cache


@click.group()
def main() -> None:
    """mokv: a Mojo- and MAX-native KV cache for LLM inference."""


@main.group()
def bench() -> None:
    """Benchmarks that run mokv side by side with MAX's own KV cache and
    kernels, or with mokv's kernels at another git revision."""


for command in (generate, chat, inspect_cache):
    main.add_command(command)
for command in (bench_manager, bench_attention, bench_e2e, bench_kernels, bench_soak):
    bench.add_command(command)
