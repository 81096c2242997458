"""The prefix-caching part of `mokv bench e2e`: mokv at several batch sizes on a
shared-system-prompt workload, with and without prefix caching.

Each case first answers one untimed request with the same system prompt on the same cache, as
a server would have before the batch arrives: with prefix caching on, the batch then finds the
system prompt's pages already computed. (Requests admitted in the same step cannot share
pages: a page is committed to the prefix cache only once its step has computed it.)"""

from __future__ import annotations

import time
from typing import Any

import click

from mokv_examples.pipeline import GenerationConfig, SmolLM2, generate, pages_to_hold
from mokv_examples.prompts import chat_prompts


def prefix_rows(
    model: SmolLM2, batches: tuple[int, ...], max_new_tokens: int, page_size: int, tiers: dict[str, Any]
) -> list[dict]:
    """mokv at each batch size, prefix caching on and off, on a shared-system-prompt
    workload, with the KV tiers in `tiers` (`tier_options`)."""
    rows = []
    for batch in batches:
        warm_up, *prompts = chat_prompts(model.tokenizer, batch + 1)
        for prefix in (True, False):
            config = GenerationConfig(
                max_new_tokens=max_new_tokens,
                page_size=page_size,
                num_pages=pages_to_hold([warm_up, *prompts], max_new_tokens, page_size),
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
