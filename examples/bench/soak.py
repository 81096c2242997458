"""`mokv bench soak`: many requests through the paged manager, watching for leaks.

The trace mixes shared system prompts (so prefix hits, dedup and evictions to
the host tier and back all happen) with random suffixes, in batches that
prefill, decode a few tokens and release. Along the way it samples the
process's resident memory and audits the manager's invariants; at the end no
page may be in use. Resident growth after a warm-up is bounded: a manager
that leaked one small object per request would grow by megabytes over 10^5
requests. Writes `soak.json`, `soak.md` and `soak.png` (resident memory over
requests); exits non-zero when a bound is broken.
"""

from __future__ import annotations

import gc
import resource
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import click
import numpy as np
from max.dtype import DType

from mokv import InsufficientBlocksError, KVCacheParams, PagedKVCacheManager, TextContext
from mokv_examples.bench.results import out_dir_option, write_results

_VOCAB = 32000


@dataclass(frozen=True)
class SoakConfig:
    """The trace and the cache it runs on."""

    requests: int = 100_000
    batch_size: int = 32
    page_size: int = 16
    total_num_pages: int = 384
    total_num_host_pages: int = 512
    system_prompts: int = 64
    system_len: int = 96
    suffix_len: int = 24
    decode_steps: int = 4
    warmup_fraction: float = 0.05
    max_growth_mib: float = 16.0


def resident_bytes() -> int:
    """This process's resident memory now (Linux `/proc`; peak RSS elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * resource.getpagesize()
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def run_soak(config: SoakConfig, progress: bool = True) -> dict[str, Any]:
    """Serves `config.requests` requests; returns the measurements."""
    rng = np.random.default_rng(0)
    params = KVCacheParams(
        DType.float32,
        n_kv_heads=1,
        head_dim=8,
        num_layers=1,
        page_size=config.page_size,
        enable_prefix_caching=True,
    )
    manager = PagedKVCacheManager(
        params, None, config.total_num_pages, config.total_num_host_pages, max_batch_size=config.batch_size
    )
    replica = manager._replicas[0]
    systems = rng.integers(0, _VOCAB, size=(config.system_prompts, config.system_len))
    num_batches = -(-config.requests // config.batch_size)
    warmup_batch = max(1, int(num_batches * config.warmup_fraction))
    samples: list[tuple[int, int]] = []
    rejected = audits = 0
    start = time.perf_counter()
    served = 0
    for b in range(num_batches):
        size = min(config.batch_size, config.requests - served)
        suffixes = rng.integers(0, _VOCAB, size=(size, config.suffix_len))
        which = rng.integers(0, config.system_prompts, size=size)
        batch = []
        for i in range(size):
            ctx = TextContext(served + i, np.concatenate([systems[which[i]], suffixes[i]]))
            manager.claim(ctx.request_id)
            try:
                manager.alloc(ctx)
                batch.append(ctx)
            except InsufficientBlocksError:
                manager.release(ctx.request_id)
                rejected += 1
        for step in range(config.decode_steps + 1):
            if step:
                for ctx in batch:
                    manager.alloc(ctx)
            manager.runtime_inputs([batch])
            for token, ctx in zip(rng.integers(0, _VOCAB, size=len(batch)).tolist(), batch, strict=True):
                ctx.update(token)
            manager.step([batch])
        for ctx in batch:
            manager.release(ctx.request_id)
        served += size
        if b % 64 == 0 or b == num_batches - 1:
            replica.check_invariants()
            audits += 1
        if b + 1 == warmup_batch or b == num_batches - 1:
            gc.collect()  # a stable baseline and end point: garbage the collector had not reached yet is no leak
        if b + 1 == warmup_batch or (b + 1) % max(1, num_batches // 100) == 0 or b == num_batches - 1:
            samples.append((served, resident_bytes()))
            if progress and (len(samples) % 10 == 0 or b == num_batches - 1):
                click.echo(f"{served}/{config.requests} requests, RSS {samples[-1][1] / 2**20:.1f} MiB", err=True)
    elapsed = time.perf_counter() - start
    after_warmup = [rss for n, rss in samples if n >= warmup_batch * config.batch_size]
    growth = max(after_warmup) - after_warmup[0]
    metrics = manager.get_metrics_aggregated()
    return {
        "config": asdict(config),
        "requests": served,
        "rejected": rejected,
        "seconds": round(elapsed, 2),
        "us_per_request": round(elapsed / served * 1e6, 1),
        "rss_after_warmup_mib": round(after_warmup[0] / 2**20, 2),
        "rss_max_mib": round(max(after_warmup) / 2**20, 2),
        "rss_growth_mib": round(growth / 2**20, 2),
        "pages_in_use_at_end": manager.get_num_used_pages(),
        "requests_live_at_end": len(replica.requests),
        "invariant_audits": audits,
        "cache_hit_rate": round(metrics.cache_hit_rate, 4),
        "d2h_blocks_copied": metrics.d2h_blocks_copied,
        "h2d_blocks_copied": metrics.h2d_blocks_copied,
        "samples": samples,
    }


def failures(result: dict[str, Any]) -> list[str]:
    """The bounds the run broke, in words (empty when it passed)."""
    broken = []
    if result["rss_growth_mib"] > result["config"]["max_growth_mib"]:
        broken.append(
            f"resident memory grew {result['rss_growth_mib']} MiB after warm-up "
            f"(bound {result['config']['max_growth_mib']} MiB)"
        )
    if result["pages_in_use_at_end"] or result["requests_live_at_end"]:
        broken.append(
            f"{result['pages_in_use_at_end']} pages and {result['requests_live_at_end']} requests "
            "still in use at the end"
        )
    return broken


def to_markdown(result: dict[str, Any]) -> str:
    c = result["config"]
    rows = [
        ("requests served", f"{result['requests']} ({result['rejected']} rejected for want of pages)"),
        ("time", f"{result['seconds']} s ({result['us_per_request']} µs per request)"),
        ("resident memory after warm-up", f"{result['rss_after_warmup_mib']} MiB"),
        ("resident memory, most after warm-up", f"{result['rss_max_mib']} MiB"),
        ("growth after warm-up", f"{result['rss_growth_mib']} MiB (bound {c['max_growth_mib']} MiB)"),
        ("pages in use at the end", str(result["pages_in_use_at_end"])),
        ("invariant audits", str(result["invariant_audits"])),
        ("prefix hit rate", str(result["cache_hit_rate"])),
        ("pages offloaded / restored (host tier)", f"{result['d2h_blocks_copied']} / {result['h2d_blocks_copied']}"),
    ]
    header = (
        "# mokv paged manager soak\n\n"
        f"Page size {c['page_size']}, {c['total_num_pages']} device pages, {c['total_num_host_pages']} host pages, "
        f"prefix caching on; batches of {c['batch_size']}: one of {c['system_prompts']} {c['system_len']}-token "
        f"system prompts + {c['suffix_len']} random tokens, {c['decode_steps']} decode steps."
    )
    verdict = failures(result) or ["passed: growth within bound, no page in use at the end"]
    lines = [header, "", "| measure | value |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in rows]
    return "\n".join([*lines, "", *(f"**{v}**" for v in verdict)]) + "\n"


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    served, rss = zip(*result["samples"], strict=True)
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.plot(served, np.asarray(rss) / 2**20, marker=".")
    ax.set_xlabel("requests served")
    ax.set_ylabel("resident memory (MiB)")
    ax.set_title("mokv paged manager soak")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


@click.command("soak")
@click.option("--requests", type=click.IntRange(min=1), default=100_000, show_default=True)
@click.option(
    "--max-growth-mib",
    type=click.FloatRange(min=0),
    default=16.0,
    show_default=True,
    help="Most resident memory growth allowed after warm-up.",
)
@out_dir_option("soak")
def soak(requests: int, max_growth_mib: float, out_dir: Path) -> None:
    """Many requests through the paged manager (prefix caching + host tier): bounded memory, no leaked page."""
    result = run_soak(SoakConfig(requests=requests, max_growth_mib=max_growth_mib))
    write_results(out_dir, "soak", [result], to_markdown(result))
    plot(result, out_dir / "soak.png")
    broken = failures(result)
    if broken:
        raise click.ClickException("; ".join(broken))
