"""`mokv bench serve`: a multi-turn chat workload through `max serve`, MAX's own
KV cache and kernels against mokv's, same model, same server settings, one run.

Each engine gets a fresh server (`mokv_examples.max_server`, one at a time)
on the same model directory and flags; they differ only in
`--custom-architectures mokv.pipelines.architecture` (mokv's attention,
kernels and manager). Before timing, one request runs every graph once.
Then `--clients` conversations run concurrently through the official `openai`
async client: each shares one system prompt, has its own first question and
asks `--turns` questions in turn, every turn resending the whole history and
streaming `--new-tokens` tokens (EOS ignored, so both engines produce equal
token counts). Per engine:

- time to first token (request sent to first streamed token), p50 and p99;
- output tokens/s: completion tokens over the wall time of the workload;
- prefix hit rate: prompt tokens the server served from its cache
  (`maxserve_cache_hits_tokens_total` over hits + misses, from its metrics).

Results: `serve.json`, `serve.md` and `serve.png` under `--out`, with the
machine's load average and the date. `--rounds 2` runs the engines twice,
alternating, to see the noise. `--mokv-page-size 16` gives mokv's server its
own page size (MAX's own manager takes multiples of 128 only): finer pages
serve more of each resent history from the cache, which is the point of the
comparison it adds; every row records its engine's page size.
"""

from __future__ import annotations

import asyncio
import datetime
import os
import tempfile
import time
from pathlib import Path

import click
import numpy as np

from mokv_examples.bench.results import out_dir_option, write_results
from mokv_examples.chat_stream import StreamedTurn, stream_chat
from mokv_examples.max_model import default_model_dir, ensure_model_dir, weights_file
from mokv_examples.max_server import MaxServer, ServeOptions

DEVICE_WEIGHTS = {"cpu": "float32", "gpu": "bfloat16"}
"""The weights each device serves: float32 on the CPU (MAX 26.7's Llama computes NaN logits
from the q4_0 file there, docs/max-pipelines.md), bfloat16 on a GPU (it takes no float32 GGUF
there)."""
SYSTEM_PROMPT = (
    "You are a concise assistant for engineers who operate large language model inference services. "
    "You explain caching, batching, memory and latency trade-offs in plain words, with one concrete "
    "example each time, and you never invent numbers you were not given. When a question is vague, "
    "you say which assumption you made. Keys and values of every attention layer are kept in pages, "
    "a shared prefix is computed once, and the least recently used pages are evicted first."
)
QUESTIONS = (
    "What does a KV cache store?",
    "Why does a shared system prompt make the second request faster?",
    "What happens when the cache is full?",
    "How does batching change time to first token?",
    "What is a cache salt for?",
    "Why are pages a fixed size?",
)


async def _conversation(api: object, model: str, index: int, turns: int, new_tokens: int) -> list[StreamedTurn]:
    """One client's turns, each resending the whole history."""
    messages = [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": f"I am engineer number {index}. {QUESTIONS[index % len(QUESTIONS)]}"},
    ]
    out = []
    for turn in range(turns):
        if turn:
            messages.append({"role": "user", "content": QUESTIONS[(index + turn) % len(QUESTIONS)]})
        out.append(await stream_chat(api, model, messages, new_tokens))
        messages.append({"role": "assistant", "content": out[-1].text})
    return out


async def _workload(server: MaxServer, clients: int, turns: int, new_tokens: int) -> list[StreamedTurn]:
    import openai

    async with openai.AsyncOpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=3600) as api:
        runs = await asyncio.gather(*(_conversation(api, server.model, i, turns, new_tokens) for i in range(clients)))
    return [turn for run in runs for turn in run]


def run_engine(options: ServeOptions, log: Path, clients: int, turns: int, new_tokens: int) -> dict:
    """One engine's server started, warmed up, measured and stopped."""
    started = time.perf_counter()
    with MaxServer(options, log) as server:
        start_s = time.perf_counter() - started
        asyncio.run(_workload(server, 1, 1, 2))  # every graph once, off the clock
        before = server.metrics()
        began = time.perf_counter()
        turns_done = asyncio.run(_workload(server, clients, turns, new_tokens))
        wall = max(t.ended for t in turns_done) - began
        time.sleep(2.0)  # the metrics process receives the last batch's counters asynchronously
        after = server.metrics()
        rss = server.rss_bytes()
    hits = after.value("maxserve_cache_hits_tokens_total") - before.value("maxserve_cache_hits_tokens_total")
    misses = after.value("maxserve_cache_misses_tokens_total") - before.value("maxserve_cache_misses_tokens_total")
    ttft = np.array([t.ttft_s for t in turns_done])
    tokens = sum(t.completion_tokens for t in turns_done)
    return {
        "engine": "mokv" if options.mokv else "MAX",
        "requests": len(turns_done),
        "ttft_p50_ms": float(np.percentile(ttft, 50) * 1000),
        "ttft_p99_ms": float(np.percentile(ttft, 99) * 1000),
        "ttft_mean_ms": float(ttft.mean() * 1000),
        "output_tokens": tokens,
        "wall_s": wall,
        "output_tokens_per_s": tokens / wall,
        "prefix_hit_rate": hits / (hits + misses) if hits + misses else 0.0,
        "prompt_tokens": int(hits + misses),
        "page_size": options.page_size,
        "cache_pages": int(after.value("maxserve_cache_num_total_blocks")),
        "server_start_s": start_s,
        "server_rss_mib": rss / 2**20,
        "ttft_ms": [float(v * 1000) for v in ttft],
    }


def markdown(rows: list[dict], setup: dict) -> str:
    out = (
        f"`mokv bench serve` on {setup['date']}: {setup['clients']} concurrent conversations x "
        f"{setup['turns']} turns, {setup['new_tokens']} new tokens per turn, SmolLM2-135M {setup['encoding']}, "
        f"max batch {setup['max_batch_size']}, `--devices {setup['device']}`; "
        f"load average before / after: {setup['load_before']} / {setup['load_after']}.\n\n"
    )
    out += "| engine | round | page size | TTFT p50 ms | TTFT p99 ms | output tok/s | prefix hit rate | prompt tok "
    out += "| pages |\n"
    out += "|---|---|---|---|---|---|---|---|---|\n"
    for r in rows:
        out += (
            f"| {r['engine']} | {r['round']} | {r['page_size']} | {r['ttft_p50_ms']:.0f} | {r['ttft_p99_ms']:.0f} | "
            f"{r['output_tokens_per_s']:.1f} | {r['prefix_hit_rate']:.1%} | {r['prompt_tokens']} | "
            f"{r['cache_pages']} |\n"
        )
    by = {e: [r for r in rows if r["engine"] == e] for e in ("MAX", "mokv")}
    if by["MAX"] and by["mokv"]:
        ratio = np.median([r["ttft_p50_ms"] for r in by["mokv"]]) / np.median([r["ttft_p50_ms"] for r in by["MAX"]])
        speed = np.median([r["output_tokens_per_s"] for r in by["mokv"]]) / np.median(
            [r["output_tokens_per_s"] for r in by["MAX"]]
        )
        out += f"\nmokv / MAX: TTFT p50 {ratio:.2f}x, output tokens/s {speed:.2f}x (medians over rounds).\n"
    return out


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_ttft, ax_rate) = plt.subplots(1, 2, figsize=(12, 4.2))
    colors = {"MAX": "#4c72b0", "mokv": "#dd8452"}
    for r in rows:
        ttft = np.sort(r["ttft_ms"])
        share = np.arange(1, len(ttft) + 1) / len(ttft)
        style = "-" if r["round"] % 2 else "--"
        label = f"{r['engine']} (round {r['round']})"
        ax_ttft.step(ttft, share, style, where="post", color=colors[r["engine"]], label=label)
    ax_ttft.set_xscale("log")
    ax_ttft.set_xlabel("time to first token (ms, log scale)")
    ax_ttft.set_ylabel("share of requests")
    ax_ttft.set_title("time to first token")
    ax_ttft.legend()
    names = [f"{r['engine']} r{r['round']}" for r in rows]
    ax_rate.bar(names, [r["output_tokens_per_s"] for r in rows], color=[colors[r["engine"]] for r in rows])
    for i, r in enumerate(rows):
        ax_rate.text(i, r["output_tokens_per_s"], f"hits {r['prefix_hit_rate']:.0%}", ha="center", va="bottom")
    ax_rate.set_ylabel("output tokens/s")
    ax_rate.set_title("throughput (and prefix hit rate)")
    for ax in (ax_ttft, ax_rate):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


@click.command("serve")
@click.option("--quick", is_flag=True, help="4 conversations of 2 turns, 8 new tokens each.")
@out_dir_option("serve")
@click.option("--model-dir", type=click.Path(file_okay=False, path_type=Path), help="Default: mokv's cache.")
@click.option("--clients", default=8, show_default=True, help="Concurrent conversations.")
@click.option("--turns", default=4, show_default=True, help="Questions per conversation.")
@click.option("--new-tokens", default=32, show_default=True, help="Tokens streamed per turn.")
@click.option("--page-size", default=128, show_default=True, help="MAX's own manager needs a multiple of 128.")
@click.option(
    "--mokv-page-size", type=int, help="mokv's server's page size, any size (default: --page-size, as MAX's)."
)
@click.option("--max-batch-size", default=8, show_default=True)
@click.option("--rounds", default=1, show_default=True, help="Runs of both engines, alternating.")
@click.option(
    "--device",
    type=click.Choice(sorted(DEVICE_WEIGHTS)),
    default="cpu",
    show_default=True,
    help="Where both servers run: gpu serves bfloat16 weights (MAX's Llama takes no float32 GGUF there).",
)
def serve(
    quick: bool,
    out_dir: Path,
    model_dir: Path | None,
    clients: int,
    turns: int,
    new_tokens: int,
    page_size: int,
    mokv_page_size: int | None,
    max_batch_size: int,
    rounds: int,
    device: str,
) -> None:
    """TTFT, throughput and prefix hits through `max serve`: MAX's cache vs mokv's."""
    if quick:
        clients, turns, new_tokens = 4, 2, 8
    model_dir = model_dir or default_model_dir()
    encoding = DEVICE_WEIGHTS[device]
    if not (model_dir / weights_file(encoding)).exists():
        click.echo(f"writing {encoding} weights into {model_dir}...", err=True)
        ensure_model_dir(encoding, directory=model_dir)
    setup = {
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "clients": clients,
        "turns": turns,
        "new_tokens": new_tokens,
        "device": device,
        "encoding": encoding,
        "max_batch_size": max_batch_size,
        "load_before": " ".join(f"{v:.1f}" for v in os.getloadavg()),
    }
    rows = []
    with tempfile.TemporaryDirectory(prefix="mokv-bench-serve-") as scratch:
        for round_ in range(1, rounds + 1):
            for mokv in (False, True):
                options = ServeOptions(
                    model_dir,
                    weights_file(encoding),
                    mokv=mokv,
                    devices=device,
                    encoding=encoding,
                    page_size=(mokv_page_size or page_size) if mokv else page_size,
                    max_batch_size=max_batch_size,
                    cache_salt=False,
                )
                name = "mokv" if mokv else "MAX"
                click.echo(f"round {round_}: {name} (starting its server)...", err=True)
                log = Path(scratch) / f"{name}-{round_}.log"
                row = {"round": round_, **run_engine(options, log, clients, turns, new_tokens)}
                click.echo(
                    f"  TTFT p50 {row['ttft_p50_ms']:.0f} ms, p99 {row['ttft_p99_ms']:.0f} ms, "
                    f"{row['output_tokens_per_s']:.1f} tok/s, hits {row['prefix_hit_rate']:.0%}",
                    err=True,
                )
                rows.append(row)
    setup["load_after"] = " ".join(f"{v:.1f}" for v in os.getloadavg())
    write_results(out_dir, "serve", [{**setup, **r} for r in rows], markdown(rows, setup))
    plot(rows, out_dir / "serve.png")
    click.echo(f"wrote {out_dir / 'serve.png'}", err=True)
