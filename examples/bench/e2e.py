"""`mokv bench e2e`: SmolLM2 end to end, in one run: the engines (`e2e_engines`: mokv's cache
in each KV format, MAX's cache, llama.cpp) and prefix caching on and off (`e2e_prefix`).
Writes `e2e.json`, `e2e.md` and `e2e.png`.

The machine is shared, so figures are only comparable within one run.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import click
import numpy as np

from mokv_examples.bench.e2e_cache_cost import SkipAttention
from mokv_examples.bench.e2e_engines import (
    PREFILL_TOKENS,
    Case,
    engine_name,
    engine_rows,
    engines_markdown,
    kv_formats_markdown,
)
from mokv_examples.bench.e2e_llama_cpp import LlamaCpp, unavailable_reason
from mokv_examples.bench.e2e_prefix import prefix_markdown, prefix_rows
from mokv_examples.bench.references import reference
from mokv_examples.bench.results import out_dir_option, write_results
from mokv_examples.options import tier_options
from mokv_examples.pipeline import KV_DTYPES, SmolLM2
from mokv_examples.prompts import chat_prompts, long_prompt
from mokv_models.llama import load_llama_model
from mokv_models.model_files import smollm2_gguf_path
from mokv_models.weight_formats import WEIGHT_FORMATS

MAX_CACHE = "mokv bench e2e runs the same graph on MAX's own KV cache too (--no-max-cache leaves it out)"
"""Why the benchmark needs the reference package by default (its error message says so)."""


def plot(engines: list[dict], names: list[str], prefix: list[dict], path: Path) -> None:
    """The engines' tokens/s side by side, and mokv's decode throughput and wall time over
    batch size with prefix caching on and off."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4))
    columns = [*names, "llama.cpp"]
    x = np.arange(len(engines))
    for i, name in enumerate(columns):
        values = [r.get(f"{name}_tokens_per_s") or 0.0 for r in engines]
        axes[0].bar(x + (i - 1) * 0.27, values, 0.27, label=name if name == "llama.cpp" else f"{name} cache")
    axes[0].set_xticks(x, [r["case"] for r in engines])
    axes[0].set(ylabel="tokens/s", title="SmolLM2, same GGUF")
    for flag, style in ((True, "-o"), (False, "--s")):
        sel = [r for r in prefix if r["prefix_caching"] == flag]
        label = "prefix caching" if flag else "no prefix caching"
        axes[1].plot([r["batch"] for r in sel], [r["decode_tokens_per_s"] for r in sel], style, label=label)
        axes[2].plot([r["batch"] for r in sel], [r["wall_seconds"] for r in sel], style, label=label)
    axes[1].set(xscale="log", xlabel="requests in flight", ylabel="decode tokens/s", title="decode throughput (mokv)")
    axes[2].set(xscale="log", xlabel="requests in flight", ylabel="seconds", title="wall time for the batch (mokv)")
    for ax in axes:
        ax.legend()
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


@click.command("e2e")
@click.option("--quick", is_flag=True, help="Fewer new tokens; prefix-caching batches 1, 4 and 16 only.")
@out_dir_option("e2e")
@click.option("--page-size", default=16, show_default=True)
@click.option("--weights", type=click.Choice(WEIGHT_FORMATS), default=WEIGHT_FORMATS[0], show_default=True)
@click.option(
    "--max-cache/--no-max-cache", default=True, show_default=True, help="Also run the graph on MAX's own cache."
)
@click.option(
    "--against-llama-cpp", is_flag=True, help="Also run llama.cpp on the same GGUF (needs requirements-bench.txt)."
)
@click.option("--repeats", default=3, show_default=True, help="Runs per engine case; each engine's best is kept.")
@click.option(
    "--kv-dtype",
    "kv_dtypes",
    type=click.Choice(KV_DTYPES),
    multiple=True,
    help="mokv's KV formats to run, one engine each (repeatable; default: all). The prefix-caching rows use the first.",
)
@click.option(
    "--batch",
    "batch_sizes",
    type=click.IntRange(min=1),
    multiple=True,
    help="Only these prefix-caching batch sizes (repeatable); `mokv bench manager` reads 32 and 64.",
)
@tier_options
def e2e(
    quick: bool,
    out_dir: Path,
    page_size: int,
    weights: str,
    max_cache: bool,
    against_llama_cpp: bool,
    repeats: int,
    kv_dtypes: tuple[str, ...],
    batch_sizes: tuple[int, ...],
    **tiers: Any,
) -> None:
    """SmolLM2 tokens/s on mokv's cache in each KV format, MAX's cache and llama.cpp; prefix caching on and off."""
    max_cache_type = reference("max_cache", MAX_CACHE).MaxCache if max_cache else None
    first, *others = kv_dtypes or KV_DTYPES
    model = SmolLM2(weights=weights, kv_dtype=first)
    models = {engine_name(first): model}
    for kv_dtype in others:
        models[engine_name(kv_dtype)] = SmolLM2(session=model.session, weights=weights, kv_dtype=kv_dtype)
    if max_cache_type is not None:
        models["MAX"] = SmolLM2(session=model.session, weights=weights, cache=max_cache_type())
    without_cache = load_llama_model(model.session, model.checkpoint, SkipAttention())
    llama, llama_note = None, None
    if against_llama_cpp:
        llama_note = unavailable_reason()
        if llama_note is None:
            llama = LlamaCpp(smollm2_gguf_path())
        else:
            click.echo(f"skipping the llama.cpp column: {llama_note}", err=True)
    new_tokens = 32 if quick else 64
    cases = [
        Case("decode-b1", chat_prompts(model.tokenizer, 1), new_tokens),
        Case("decode-b16", chat_prompts(model.tokenizer, 16), new_tokens),
        Case(f"prefill-{PREFILL_TOKENS}", [long_prompt(model.tokenizer, PREFILL_TOKENS)], 1),
    ]
    load_before = os.getloadavg()[0]
    engines = engine_rows(models, without_cache, cases, llama, repeats)
    batches = batch_sizes or ((1, 4, 16) if quick else (1, 4, 16, 32, 64))
    prefix = prefix_rows(model, batches, 16 if quick else 32, page_size, tiers)
    names = list(models)
    markdown = (
        f"SmolLM2-135M, {weights} weights, page size {page_size}; best of {repeats} runs per engine case; "
        f"load average {load_before:.1f} before and {os.getloadavg()[0]:.1f} after, on {os.cpu_count()} cores\n\n"
        + engines_markdown(engines, names, llama_note if against_llama_cpp else "not requested (--against-llama-cpp)")
        + "\nKV formats (mokv)\n\n"
        + kv_formats_markdown(engines, models)
        + f"\nprefix caching (mokv, {first} KV)\n\n"
        + prefix_markdown(prefix)
    )
    write_results(out_dir, "e2e", [{"weights": weights, **r} for r in engines + prefix], markdown)
    plot(engines, names, prefix, out_dir / "e2e.png")
    click.echo(f"wrote {out_dir / 'e2e.png'}", err=True)
