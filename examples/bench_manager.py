"""`mokv bench manager`: mokv's paged KV cache manager against MAX 26.7's own.

Both managers serve the same trace in the same process: batches of requests
with 512-token prompts (shared-prefix or random), prefill, then 64 decode
steps, then release. Only the manager calls are timed (not context updates).
Each case reports microseconds per call of each operation, per request end to
end (all its manager calls, with batch-level calls split over the batch), and
both managers' prefix hit rates, which should agree since both implement the
same allocation and eviction policy.
"""

from __future__ import annotations

import gc
import os
import platform
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import click
import numpy as np
from max.driver import CPU
from max.dtype import DType
from max.engine import InferenceSession

from mokv import KVCacheParams, PagedKVCacheManager, TextContext
from mokv_examples.bench_results import out_dir_option, write_results
from mokv_reference.max_manager import MaxBackend

OPS = ("admit", "alloc", "runtime_inputs", "step", "release")
"""`admit` is claim + first alloc (prefix matching happens there); `alloc` the decode allocations."""
_VOCAB = 32000


@dataclass(frozen=True)
class Case:
    """One trace configuration."""

    page_size: int
    kind: str  # "shared" (4 system prompts of 384 tokens + 128 random) or "random"
    num_batches: int
    batch_size: int = 32
    prompt_len: int = 512
    decode_steps: int = 64

    @property
    def name(self) -> str:
        return f"page{self.page_size}-{self.kind}"

    @property
    def total_num_pages(self) -> int:
        """Room for two batches at full length: hits survive a batch, and eviction happens."""
        pages_per_request = -(-(self.prompt_len + self.decode_steps) // self.page_size)
        return 2 * self.batch_size * pages_per_request


def make_prompts(case: Case, seed: int = 0) -> list[np.ndarray]:
    """The trace's prompts, deterministic in `seed`."""
    rng = np.random.default_rng(seed)
    n = case.num_batches * case.batch_size
    prompts = rng.integers(0, _VOCAB, size=(n, case.prompt_len), dtype=np.int64)
    if case.kind == "shared":
        shared_len = 3 * case.prompt_len // 4
        system = rng.integers(0, _VOCAB, size=(4, shared_len), dtype=np.int64)
        prompts[:, :shared_len] = system[np.arange(n) % 4]
    return list(prompts)


class Backend(Protocol):
    """A paged KV cache manager driven through one common interface."""

    def new_context(self, request_id: str, tokens: np.ndarray) -> Any: ...
    def claim(self, ctx: Any) -> None: ...
    def alloc(self, ctx: Any) -> None: ...
    def runtime_inputs(self, batch: list[Any]) -> Any: ...
    def step(self, batch: list[Any]) -> None: ...
    def release(self, ctx: Any) -> None: ...
    def blocks(self, ctx: Any) -> list[int]: ...
    def num_free_blocks(self) -> int: ...
    def hit_rate(self) -> float: ...


class MokvBackend:
    """mokv's `PagedKVCacheManager` on replica 0."""

    def __init__(self, page_size: int, total_num_pages: int, max_batch_size: int) -> None:
        params = KVCacheParams(
            DType.float32,
            n_kv_heads=1,
            head_dim=8,
            num_layers=1,
            page_size=page_size,
            enable_prefix_caching=True,
        )
        self.manager = PagedKVCacheManager(
            params,
            InferenceSession(devices=[CPU()]),
            total_num_pages,
            max_batch_size=max_batch_size,
        )

    def new_context(self, request_id: str, tokens: np.ndarray) -> TextContext:
        return TextContext(request_id, tokens)

    def claim(self, ctx: TextContext) -> None:
        self.manager.claim(ctx.request_id, 0)

    def alloc(self, ctx: TextContext) -> None:
        self.manager.alloc(ctx, 0)

    def runtime_inputs(self, batch: list[TextContext]) -> Any:
        return self.manager.runtime_inputs([batch])

    def step(self, batch: list[TextContext]) -> None:
        self.manager.step([batch])

    def release(self, ctx: TextContext) -> None:
        self.manager.release(ctx.request_id, 0)

    def blocks(self, ctx: TextContext) -> list[int]:
        return self.manager.get_req_blocks(ctx.request_id, 0)

    def num_free_blocks(self) -> int:
        return self.manager.num_free_blocks(0)

    def hit_rate(self) -> float:
        return self.manager.get_metrics_aggregated().cache_hit_rate


@dataclass
class Timings:
    """Nanoseconds spent in each manager operation, and how many calls."""

    total_ns: dict[str, int] = field(default_factory=lambda: dict.fromkeys(OPS, 0))
    calls: dict[str, int] = field(default_factory=lambda: dict.fromkeys(OPS, 0))

    def per_call_us(self, op: str) -> float:
        return self.total_ns[op] / max(self.calls[op], 1) / 1e3


CLOCKS = {"cpu": time.thread_time_ns, "wall": time.perf_counter_ns}
"""`cpu` (the default) counts this thread's CPU time, which neighbours on a
shared machine disturb far less than elapsed time; `wall` counts elapsed time.
Each loop over a batch is timed as one region, and what an empty region
measures (the clock's own cost: several µs for `cpu` in a VM) is subtracted."""


def clock_overhead_ns(clock: Any, samples: int = 2001) -> int:
    """The median time an empty region measures with `clock`."""
    deltas = []
    for _ in range(samples):
        start = clock()
        deltas.append(clock() - start)
    return int(np.median(deltas))


def run_trace(
    backend: Backend, case: Case, prompts: list[np.ndarray], seed: int = 1, clock_name: str = "cpu"
) -> Timings:
    """Serves every batch of the trace: claim + alloc, then prefill and decode
    iterations (runtime_inputs, update, step, alloc), then release."""
    clock = CLOCKS[clock_name]
    overhead = clock_overhead_ns(clock)
    t = Timings()
    rng = np.random.default_rng(seed)

    def timed(op: str, fn: Any, *args: Any) -> None:
        start = clock()
        fn(*args)
        t.total_ns[op] += max(0, clock() - start - overhead)
        t.calls[op] += 1

    def timed_each(op: str, fn: Any, batch: list[Any]) -> None:
        start = clock()
        for ctx in batch:
            fn(ctx)
        t.total_ns[op] += max(0, clock() - start - overhead)
        t.calls[op] += len(batch)

    def admit(ctx: Any) -> None:
        backend.claim(ctx)
        backend.alloc(ctx)

    for b in range(case.num_batches):
        batch = [
            backend.new_context(f"req-{b}-{i}", prompts[b * case.batch_size + i])
            for i in range(case.batch_size)
        ]
        timed_each("admit", admit, batch)
        for it in range(case.decode_steps + 1):
            if it:
                timed_each("alloc", backend.alloc, batch)
            timed("runtime_inputs", backend.runtime_inputs, batch)
            for token, ctx in zip(
                rng.integers(0, _VOCAB, size=len(batch)).tolist(), batch, strict=True
            ):
                ctx.update(token)
            timed("step", backend.step, batch)
        timed_each("release", backend.release, batch)
    return t


def run_case(case: Case) -> list[dict[str, Any]]:
    """Both managers on one case: one JSON row per operation plus the `request` row."""
    prompts = make_prompts(case)
    backends = {
        "mokv": MokvBackend(case.page_size, case.total_num_pages, case.batch_size),
        "max": MaxBackend(case.page_size, case.total_num_pages, case.batch_size),
    }
    timings = {}
    for name, backend in backends.items():
        # Collect and freeze what exists now, so neither run pays for scanning
        # the other's (or the imports') objects; garbage it makes itself counts.
        gc.collect()
        gc.freeze()
        timings[name] = run_trace(backend, case, prompts)
        gc.unfreeze()
    num_requests = case.num_batches * case.batch_size
    rows = []
    for op in OPS:
        mokv_us, max_us = (timings[k].per_call_us(op) for k in ("mokv", "max"))
        rows.append(_row(case, op, mokv_us, max_us, calls=timings["mokv"].calls[op]))
    mokv_req, max_req = (
        sum(timings[k].total_ns.values()) / num_requests / 1e3 for k in ("mokv", "max")
    )
    rows.append(
        _row(
            case,
            "request",
            mokv_req,
            max_req,
            calls=num_requests,
            mokv_hit_rate=round(backends["mokv"].hit_rate(), 6),
            max_hit_rate=round(backends["max"].hit_rate(), 6),
        )
    )
    return rows


def _row(case: Case, op: str, mokv_us: float, max_us: float, **extra: Any) -> dict[str, Any]:
    return {
        "case": case.name,
        "op": op,
        "page_size": case.page_size,
        "prompts": case.kind,
        "mokv_us": round(mokv_us, 2),
        "max_us": round(max_us, 2),
        "speedup": round(max_us / mokv_us, 2) if mokv_us else None,
        **extra,
    }


def to_markdown(rows: list[dict[str, Any]], header: str) -> str:
    """The rows as a markdown table."""
    lines = [
        header,
        "",
        "| case | op | calls | mokv µs | MAX µs | speedup | hit rate mokv / MAX |",
        "|---|---|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        hits = f"{r['mokv_hit_rate']:.4f} / {r['max_hit_rate']:.4f}" if r["op"] == "request" else ""
        lines.append(
            f"| {r['case']} | {r['op']} | {r['calls']} | {r['mokv_us']:.1f} | "
            f"{r['max_us']:.1f} | {r['speedup']:.1f}x | {hits} |"
        )
    return "\n".join(lines) + "\n"


@click.command("manager")
@click.option("--quick", is_flag=True, help="Fewer batches per case (well under five minutes).")
@out_dir_option("manager")
def manager(quick: bool, out_dir: Path) -> None:
    """mokv's PagedKVCacheManager vs MAX 26.7's on the same request trace."""
    num_batches = 4 if quick else 16
    cases = [Case(ps, kind, num_batches) for ps in (128, 16) for kind in ("shared", "random")]
    rows: list[dict[str, Any]] = []
    for case in cases:
        click.echo(f"{case.name}: {num_batches} batches of {case.batch_size} ...", err=True)
        rows += run_case(case)
    header = (
        "# mokv vs MAX PagedKVCacheManager\n\n"
        f"{num_batches} batches of 32 requests per case; 512-token prompts (`shared`: one of 4 "
        "384-token system prompts + 128 random tokens; `random`: all random), 64 decode steps, "
        "prefix caching on. µs per call; `runtime_inputs` and `step` are per batch (MAX 26.7's "
        "`step` takes one request, so its row times the loop over the batch); `request` is all "
        "manager calls per request, batch calls split over the batch. "
        f"Host: {platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}."
    )
    markdown = to_markdown(rows, header)
    write_results(out_dir, "manager", rows, markdown)
