"""The engines part of `mokv bench e2e`: the same SmolLM2 graph on mokv's paged cache (in each
KV format) and on MAX 26.7's own (`mokv_reference.max_cache`), and with `--against-llama-cpp`
llama.cpp on the same GGUF: decode tokens/s at batch 1 and 16 and prefill tokens/s of a
500-token prompt, each engine's best of several runs taken in turns, with the cache's share of
step time (`e2e_cache_cost`)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import click
import numpy as np
import numpy.typing as npt
from max.engine import Model

from mokv_examples.bench.e2e_cache_cost import CacheCost, TimedManager
from mokv_examples.bench.e2e_llama_cpp import SPIN_DOWN_SECONDS, LlamaCpp
from mokv_examples.pipeline import GenerationConfig, SmolLM2, generate, pages_to_hold

PREFILL_TOKENS = 500
GOALS = {
    "decode-b1": ("decode-b1", 1.0),  # mokv batch-1 decode >= llama.cpp batch-1 decode
    "decode-b16": ("decode-b1", 4.0),  # mokv batch-16 decode >= 4x llama.cpp batch-1 decode
    f"prefill-{PREFILL_TOKENS}": (f"prefill-{PREFILL_TOKENS}", 1.0),
}
"""case -> (llama.cpp case it is measured against, the ratio the issue asks for)."""


@dataclass
class Case:
    """One engine case: `prompts` run together, `new_tokens` new tokens each; its name says
    whether it measures prefill or decode."""

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
        num_pages=pages_to_hold(case.prompts, case.new_tokens, GenerationConfig.page_size),
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


def run_llama_cpp(case: Case, llama: LlamaCpp) -> float | None:
    """llama.cpp's tokens/s for a batch-1 case (it has no batched decode here)."""
    if len(case.prompts) != 1:
        return None
    time.sleep(SPIN_DOWN_SECONDS)  # MAX's threads stop spinning first
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
