"""`mokv bench e2e`: SmolLM2 throughput on mokv's paged cache at several batch
sizes, with and without prefix caching, on a shared-system-prompt workload.

Each case first answers one untimed request with the same system prompt on the
same cache, as a server would have before the batch arrives: with prefix
caching on, the batch then finds the system prompt's pages already computed.
(Requests admitted in the same step cannot share pages: a page is committed to
the prefix cache only once its step has computed it.)"""

from __future__ import annotations

import time
from pathlib import Path

import click

from mokv_examples.bench_results import out_dir_option, write_results
from mokv_examples.generate import tier_options
from mokv_examples.inspect_cache import QUESTIONS, SYSTEM_PROMPT
from mokv_examples.pipeline import GenerationConfig, SmolLM2, generate


def workload(model: SmolLM2, n: int) -> list:
    """`n` chat prompts sharing one system prompt, each with its own question,
    after one warm-up prompt (index 0) with the same system prompt."""
    return [
        model.tokenizer.encode_chat(
            [
                {"role": "system", "content": SYSTEM_PROMPT},
                {"role": "user", "content": f"{QUESTIONS[i % len(QUESTIONS)]} (#{i})"},
            ]
        )
        for i in range(n + 1)
    ]


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for prefix, style in ((True, "-o"), (False, "--s")):
        sel = [r for r in rows if r["prefix_caching"] == prefix]
        label = "prefix caching" if prefix else "no prefix caching"
        axes[0].plot([r["batch"] for r in sel], [r["decode_tokens_per_s"] for r in sel], style, label=label)
        axes[1].plot([r["batch"] for r in sel], [r["wall_seconds"] for r in sel], style, label=label)
    axes[0].set(xscale="log", xlabel="requests in flight", ylabel="decode tokens/s", title="decode throughput")
    axes[1].set(xscale="log", xlabel="requests in flight", ylabel="seconds", title="wall time for the batch")
    for ax in axes:
        ax.legend()
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


@click.command("e2e")
@click.option("--quick", is_flag=True, help="Batches 1, 4 and 16 with fewer new tokens.")
@out_dir_option("e2e")
@click.option("--page-size", default=16, show_default=True)
@click.option(
    "--batch",
    "batch_sizes",
    type=click.IntRange(min=1),
    multiple=True,
    help="Only these batch sizes (repeatable); `mokv bench manager` reads 32 and 64.",
)
@tier_options
def e2e(quick: bool, out_dir: Path, page_size: int, batch_sizes: tuple[int, ...], **tiers: object) -> None:
    """Throughput at batch 1, 4, 16, 32, 64 with and without prefix caching."""
    batches = batch_sizes or ((1, 4, 16) if quick else (1, 4, 16, 32, 64))
    max_new_tokens = 16 if quick else 32
    model = SmolLM2()
    rows = []
    for batch in batches:
        warm_up, *prompts = workload(model, batch)
        for prefix in (True, False):
            config = GenerationConfig(
                max_new_tokens=max_new_tokens,
                page_size=page_size,
                num_pages=1024,
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
    header = (
        "| case | prompt tokens | prefilled | prefill tok/s | decode tok/s | hit rate | wall s |\n"
        "|---|---|---|---|---|---|---|\n"
    )
    lines = [
        f"| {r['case']} | {r['prompt_tokens']} | {r['prefill_tokens']} | {r['prefill_tokens_per_s']:.0f} | "
        f"{r['decode_tokens_per_s']:.1f} | {r['prefix_hit_rate']:.0%} | {r['wall_seconds']:.1f} |"
        for r in rows
    ]
    write_results(out_dir, "e2e", rows, header + "\n".join(lines) + "\n")
    plot(rows, out_dir / "e2e.png")
    click.echo(f"wrote {out_dir / 'e2e.png'}", err=True)
