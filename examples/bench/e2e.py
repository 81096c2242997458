"""`mokv bench e2e`: SmolLM2 end to end, in one run:

1. engines: the same model graph on mokv's paged cache and on MAX 26.7's own
   (`mokv_reference.max_cache`), and with `--against-llama-cpp` llama.cpp on the
   same GGUF: decode tokens/s at batch 1 and 16 and prefill tokens/s of a
   500-token prompt. For both caches, the cache's share of step time: the
   seconds spent in the manager's calls plus the graph's store and attention
   ops, the latter measured as the step's time minus that of the same graph
   with attention skipped (`SkipAttention`), run on the same inputs right after
   every step.
2. prefix caching: mokv at batch 1, 4, 16 (and 64) on a shared-system-prompt
   workload, with and without prefix caching. Each case first answers one
   untimed request with the same system prompt on the same cache, as a server
   would have before the batch arrives: with prefix caching on, the batch then
   finds the system prompt's pages already computed. (Requests admitted in the
   same step cannot share pages: a page is committed to the prefix cache only
   once its step has computed it.)

The machine is shared, so figures are only comparable within one run.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click
import numpy as np
import numpy.typing as npt
from max.driver import Buffer
from max.engine import Model
from max.graph import BufferType, TensorType, TensorValue, Value

from mokv_examples.bench import e2e_llama_cpp as llama_cpp_bench
from mokv_examples.bench.results import out_dir_option, write_results
from mokv_examples.generate import tier_options
from mokv_examples.inspect_cache import QUESTIONS, SYSTEM_PROMPT
from mokv_examples.pipeline import KV_DTYPES, GenerationConfig, SmolLM2, generate
from mokv_examples.scheduler import CacheInputs, Scheduler
from mokv_models.llama import last_token_rows, load_llama_model
from mokv_models.model_files import smollm2_gguf_path
from mokv_models.weight_formats import WEIGHT_FORMATS

PREFILL_TOKENS = 500
GOALS = {
    "decode-b1": ("decode-b1", 1.0),  # mokv batch-1 decode >= llama.cpp batch-1 decode
    "decode-b16": ("decode-b1", 4.0),  # mokv batch-16 decode >= 4x llama.cpp batch-1 decode
    f"prefill-{PREFILL_TOKENS}": (f"prefill-{PREFILL_TOKENS}", 1.0),
}
"""case -> (llama.cpp case it is measured against, the ratio the issue asks for)."""


class SkipAttention:
    """An attention backend that costs nothing (it returns the queries): the same
    graph without the cache, to time what the cache's ops cost in a step."""

    custom_extensions: tuple[Path, ...] = ()

    def input_types(self) -> list[TensorType | BufferType]:
        return []

    def __call__(
        self,
        layer_idx: int,
        q: TensorValue,
        k: TensorValue,
        v: TensorValue,
        input_row_offsets: TensorValue,
        graph_inputs: Sequence[Value],
    ) -> TensorValue:
        return q


class TimedManager:
    """Forwards every call to a cache manager, adding up the seconds spent in them."""

    def __init__(self, manager: Any) -> None:
        self._manager = manager
        self.seconds = 0.0

    def __getattr__(self, name: str) -> Any:
        attribute = getattr(self._manager, name)
        if not callable(attribute):
            return attribute

        def timed(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return attribute(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - started

        return timed


class CacheCost:
    """Times a pipeline's steps and, after each one, the cache-free graph on the same
    inputs (outside the scheduler's step timing, which stays the model's alone)."""

    def __init__(self, model: SmolLM2, without_cache: Model) -> None:
        self.model = model
        self.without_cache = without_cache
        self.step_seconds = 0.0
        self.skipped_seconds = 0.0
        self._last: list[Buffer] = []

    def step(
        self,
        tokens: npt.NDArray[np.int64],
        row_offsets: npt.NDArray[np.uint32],
        positions: npt.NDArray[np.int64],
        cache: CacheInputs,
    ) -> npt.NDArray[np.float32]:
        self._last = [Buffer.from_numpy(a) for a in (tokens, row_offsets, positions, last_token_rows(row_offsets))]
        started = time.perf_counter()
        logits = self.model.step(tokens, row_offsets, positions, cache)
        self.step_seconds += time.perf_counter() - started
        return logits

    def after_step(self, scheduler: Scheduler) -> None:
        started = time.perf_counter()
        self.without_cache.execute(*self._last)
        self.skipped_seconds += time.perf_counter() - started

    def share(self, manager_seconds: float) -> float:
        """The cache's share of step time: manager calls plus store and attention ops."""
        cache_ops = max(0.0, self.step_seconds - self.skipped_seconds)
        return (manager_seconds + cache_ops) / (self.step_seconds + manager_seconds)


def chat_prompts(model: SmolLM2, n: int) -> list[npt.NDArray[np.int64]]:
    """`n` chat prompts sharing one system prompt, each with its own question."""
    return [
        model.tokenizer.encode_chat(
            [
                {"role": "system", "content": SYSTEM_PROMPT},
                {"role": "user", "content": f"{QUESTIONS[i % len(QUESTIONS)]} (#{i})"},
            ]
        )
        for i in range(n)
    ]


def long_prompt(model: SmolLM2, tokens: int) -> npt.NDArray[np.int64]:
    """A prompt of exactly `tokens` tokens of plain English."""
    text = " ".join(f"{SYSTEM_PROMPT} Question {i}: {QUESTIONS[i % len(QUESTIONS)]}" for i in range(64))
    ids = model.tokenizer.encode(text)
    if len(ids) < tokens:
        raise ValueError(f"the long prompt has only {len(ids)} tokens")
    return ids[:tokens]


def pages_for(prompts: Sequence[npt.NDArray[np.int64]], new_tokens: int, page_size: int) -> int:
    """Pages that hold every prompt with its new tokens at once (no preemption)."""
    return sum(-(-(len(p) + new_tokens) // page_size) for p in prompts) + 1


@dataclass
class Case:
    name: str
    prompts: list[npt.NDArray[np.int64]]
    new_tokens: int

    @property
    def measures(self) -> str:
        return "prefill" if self.name.startswith("prefill") else "decode"


def run_case(model: SmolLM2, without_cache: Model, case: Case) -> dict[str, float]:
    """One case on one cache: tokens/s of what it measures and the cache's share of step time."""
    config = GenerationConfig(
        max_new_tokens=case.new_tokens,
        num_pages=pages_for(case.prompts, case.new_tokens, GenerationConfig.page_size),
        max_batch_size=len(case.prompts),
        token_budget=2048,
        enable_prefix_caching=False,
    )
    generate(model, case.prompts[:1], GenerationConfig(max_new_tokens=2, num_pages=64))  # warm the weights' pages
    manager = TimedManager(model.new_manager(config))
    cost = CacheCost(model, without_cache)
    _, stats, _ = generate(model, case.prompts, config, on_step=cost.after_step, manager=manager, step=cost.step)
    rate = stats.prefill_tokens_per_s if case.measures == "prefill" else stats.decode_tokens_per_s
    return {
        "tokens_per_s": rate,
        "cache_share": cost.share(manager.seconds),
        "manager_s": manager.seconds,
        "step_s": cost.step_seconds,
    }


def run_llama_cpp(case: Case, llama: llama_cpp_bench.LlamaCpp) -> float | None:
    """llama.cpp's tokens/s for a batch-1 case (it has no batched decode here)."""
    if len(case.prompts) != 1:
        return None
    time.sleep(llama_cpp_bench.SPIN_DOWN_SECONDS)  # MAX's threads stop spinning first
    if case.measures == "prefill":
        llama.prefill_seconds(case.prompts[0])  # warm-up
        return len(case.prompts[0]) / min(llama.prefill_seconds(case.prompts[0]) for _ in range(3))
    llama.decode(case.prompts[0], 4)  # warm-up
    _, seconds = llama.decode(case.prompts[0], case.new_tokens)
    return (case.new_tokens - 1) / seconds


def engine_rows(
    models: dict[str, SmolLM2], without_cache: Model, cases: list[Case], llama: Any, repeats: int
) -> list[dict]:
    """Every case on every engine, `repeats` times with the engines taking turns; each
    engine's best run is kept (on a shared machine the best run is the one least disturbed
    by neighbours, and spinning runtimes, MAX's and llama.cpp's alike, suffer most)."""
    rows = [{"case": case.name, "batch": len(case.prompts), "measures": case.measures} for case in cases]
    for repeat in range(repeats):
        for case, row in zip(cases, rows, strict=True):
            for name, model in models.items():
                result = run_case(model, without_cache, case)
                if result["tokens_per_s"] > row.get(f"{name}_tokens_per_s", 0.0):
                    row[f"{name}_tokens_per_s"] = result["tokens_per_s"]
                    row[f"{name}_cache_share"] = result["cache_share"]
            rate = run_llama_cpp(case, llama) if llama is not None else None
            row["llama.cpp_tokens_per_s"] = max(rate or 0.0, row.get("llama.cpp_tokens_per_s") or 0.0) or None
            shown = ", ".join(
                f"{name} {row[f'{name}_tokens_per_s']:.1f} tok/s (cache {row[f'{name}_cache_share']:.0%})"
                for name in models
            )
            if row["llama.cpp_tokens_per_s"] is not None:
                shown += f", llama.cpp {row['llama.cpp_tokens_per_s']:.1f} tok/s"
            click.echo(f"[{repeat + 1}/{repeats}] {case.name:>12}: best so far {shown}", err=True)
    return rows


def engines_markdown(rows: list[dict], names: list[str], llama_note: str | None) -> str:
    header = ["case"] + [f"{n} cache tok/s" for n in names] + ["llama.cpp tok/s"] + [f"{n} cache share" for n in names]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    by_case = {r["case"]: r for r in rows}
    for r in rows:
        llama = r["llama.cpp_tokens_per_s"]
        cells = [
            r["case"],
            *(f"{r[f'{n}_tokens_per_s']:.1f}" for n in names),
            "–" if llama is None else f"{llama:.1f}",
            *(f"{r[f'{n}_cache_share']:.0%}" for n in names),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    if llama_note:
        lines.append(f"llama.cpp column skipped: {llama_note}")
    for case, (against, goal) in GOALS.items():
        if case in by_case and by_case.get(against, {}).get("llama.cpp_tokens_per_s"):
            ratio = by_case[case][f"{names[0]}_tokens_per_s"] / by_case[against]["llama.cpp_tokens_per_s"]
            verdict = "met" if ratio >= goal else "not met"
            lines.append(f"- {case}: mokv / llama.cpp {against} = {ratio:.2f} (goal >= {goal:g}: {verdict})")
    return "\n".join(lines) + "\n"


def engine_name(kv_dtype: str) -> str:
    """mokv's engine column for a KV format: plain "mokv" for float32."""
    return "mokv" if kv_dtype == "float32" else f"mokv-{kv_dtype}"


def kv_formats_markdown(rows: list[dict], models: dict[str, SmolLM2]) -> str:
    """One row per KV format of mokv's cache: bytes per cached token and each case's tokens/s."""
    cases = [r["case"] for r in rows]
    header = ["KV format", "bytes per token", *(f"{c} tok/s" for c in cases)]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for name, model in models.items():
        if not name.startswith("mokv"):
            continue
        cells = [model.kv_dtype, f"{model.cache_params().bytes_per_token:g}"]
        cells += [f"{r[f'{name}_tokens_per_s']:.1f}" for r in rows]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def prefix_rows(
    model: SmolLM2, batches: tuple[int, ...], max_new_tokens: int, page_size: int, tiers: dict[str, Any]
) -> list[dict]:
    """mokv at each batch size, prefix caching on and off, on a shared-system-prompt
    workload, with the KV tiers in `tiers` (`tier_options`)."""
    rows = []
    for batch in batches:
        warm_up, *prompts = chat_prompts(model, batch + 1)
        for prefix in (True, False):
            config = GenerationConfig(
                max_new_tokens=max_new_tokens,
                page_size=page_size,
                num_pages=pages_for([warm_up, *prompts], max_new_tokens, page_size),
                enable_prefix_caching=prefix,
                max_batch_size=batch,
                token_budget=2048,
                host_pages=tiers["host_cache_pages"],
                disk_cache=tiers["disk_cache"],
                remote_cache=tiers["remote_cache"],
            )
            _, _, manager = generate(model, [warm_up], config)
            manager.reset_metrics()
            started = time.perf_counter()
            requests, stats, manager = generate(model, prompts, config, manager=manager)
            wall = time.perf_counter() - started
            manager.shutdown()
            row = {
                "case": f"batch{batch}-{'prefix' if prefix else 'noprefix'}",
                "batch": batch,
                "prefix_caching": prefix,
                "prompt_tokens": sum(len(r.prompt) for r in requests),
                "prefill_tokens": stats.prefill_tokens,
                "decode_tokens": stats.decode_tokens,
                "prefill_tokens_per_s": stats.prefill_tokens_per_s,
                "decode_tokens_per_s": stats.decode_tokens_per_s,
                "prefix_hit_rate": manager.get_metrics_aggregated().cache_hit_rate,
                "wall_seconds": wall,
            }
            rows.append(row)
            click.echo(
                f"{row['case']:>18}: prefill {row['prefill_tokens']:5d} tok"
                f" at {row['prefill_tokens_per_s']:7.0f} tok/s, "
                f"decode {row['decode_tokens_per_s']:6.1f} tok/s, hit rate {row['prefix_hit_rate']:.0%}, {wall:.1f} s",
                err=True,
            )
    return rows


def prefix_markdown(rows: list[dict]) -> str:
    header = (
        "| case | prompt tokens | prefilled | prefill tok/s | decode tok/s | hit rate | wall s |\n"
        "|---|---|---|---|---|---|---|\n"
    )
    return (
        header
        + "\n".join(
            f"| {r['case']} | {r['prompt_tokens']} | {r['prefill_tokens']} | {r['prefill_tokens_per_s']:.0f} | "
            f"{r['decode_tokens_per_s']:.1f} | {r['prefix_hit_rate']:.0%} | {r['wall_seconds']:.1f} |"
            for r in rows
        )
        + "\n"
    )


def plot(engines: list[dict], names: list[str], prefix: list[dict], path: Path) -> None:
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
    first, *others = kv_dtypes or KV_DTYPES
    model = SmolLM2(weights=weights, kv_dtype=first)
    models = {engine_name(first): model}
    for kv_dtype in others:
        models[engine_name(kv_dtype)] = SmolLM2(session=model.session, weights=weights, kv_dtype=kv_dtype)
    if max_cache:
        from mokv_reference.max_cache import MaxCache

        models["MAX"] = SmolLM2(session=model.session, weights=weights, cache=MaxCache())
    without_cache = load_llama_model(model.session, model.checkpoint, SkipAttention())
    llama, llama_note = None, None
    if against_llama_cpp:
        llama_note = llama_cpp_bench.unavailable_reason()
        if llama_note is None:
            llama = llama_cpp_bench.LlamaCpp(smollm2_gguf_path())
        else:
            click.echo(f"skipping the llama.cpp column: {llama_note}", err=True)
    new_tokens = 32 if quick else 64
    cases = [
        Case("decode-b1", chat_prompts(model, 1), new_tokens),
        Case("decode-b16", chat_prompts(model, 16), new_tokens),
        Case(f"prefill-{PREFILL_TOKENS}", [long_prompt(model, PREFILL_TOKENS)], 1),
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
