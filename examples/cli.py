"""The `mokv` command line: one click group, each pipeline in its own module."""

from __future__ import annotations

import click

from mokv.about import report
from mokv.paths import keep_compiled_graphs_in_cache_dir
from mokv_examples.bench.attention import attention as bench_attention
from mokv_examples.bench.e2e import e2e as bench_e2e
from mokv_examples.bench.kernels import kernels as bench_kernels
from mokv_examples.bench.manager import manager as bench_manager
from mokv_examples.bench.serve import serve as bench_serve
from mokv_examples.bench.soak import soak as bench_soak
from mokv_examples.bench.tiers import tiers as bench_tiers
from mokv_examples.bench.weights import weights as bench_weights
from mokv_examples.chat import chat
from mokv_examples.generate import generate
from mokv_examples.inspect_cache import inspect_cache
from mokv_examples.max_model import max_model
from mokv_examples.score import score


def _print_report(ctx: click.Context, _param: click.Parameter, value: bool) -> None:
    if value and not ctx.resilient_parsing:
        click.echo(report())
        ctx.exit()


@click.group()
@click.option(
    "--version",
    is_flag=True,
    expose_value=False,
    is_eager=True,
    callback=_print_report,
    help="Versions of mokv, MAX and Mojo, and where the kernels and caches are.",
)
def main() -> None:
    """mokv: a Mojo- and MAX-native KV cache for LLM inference."""
    # Compiled graphs are cached beside the precompiled kernels, under mokv's
    # cache directory, so every way of running `mokv` reuses them.
    keep_compiled_graphs_in_cache_dir()


@main.group()
def bench() -> None:
    """Benchmarks that run mokv side by side with MAX's own KV cache and
    kernels, or with mokv's kernels at another git revision."""


for command in (generate, chat, score, inspect_cache, max_model):
    main.add_command(command)
for command in (
    bench_manager,
    bench_attention,
    bench_e2e,
    bench_kernels,
    bench_weights,
    bench_tiers,
    bench_soak,
    bench_serve,
):
    bench.add_command(command)

if __name__ == "__main__":
    main()
