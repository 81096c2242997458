"""The `mokv` command line: one click group, each pipeline in its own module."""

from __future__ import annotations

import click


@click.group()
def main() -> None:
    """mokv: a Mojo- and MAX-native KV cache for LLM inference."""


@main.group()
def bench() -> None:
    """Benchmarks that compare mokv with MAX's own KV cache side by side."""


from mokv_examples.bench_manager import manager as _bench_manager

bench.add_command(_bench_manager)
