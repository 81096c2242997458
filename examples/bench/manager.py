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
import json
import os
import platform
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click
import numpy as np

from mokv_examples.bench.references import reference
from mokv_examples.bench.results import out_dir_option, write_results

if TYPE_CHECKING:
    from mokv_reference.manager_backends import Backend

MAX_MANAGER = "mokv bench manager times MAX's own PagedKVCacheManager beside mokv's"
"""Why the benchmark needs the reference package (its error message says so)."""
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


def trace(
    backend: Backend, case: Case, prompts: list[np.ndarray], t: Timings, seed: int = 1, clock_name: str = "cpu"
) -> Iterator[None]:
    """Serves every batch of the trace, yielding after each: claim + alloc,
    then prefill and decode iterations (runtime_inputs, update, step, alloc),
    then release. Adds the manager calls' times to `t`."""
    clock = CLOCKS[clock_name]
    overhead = clock_overhead_ns(clock)
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
        batch = [backend.new_context(f"req-{b}-{i}", prompts[b * case.batch_size + i]) for i in range(case.batch_size)]
        timed_each("admit", admit, batch)
        for it in range(case.decode_steps + 1):
            if it:
                timed_each("alloc", backend.alloc, batch)
            timed("runtime_inputs", backend.runtime_inputs, batch)
            for token, ctx in zip(rng.integers(0, _VOCAB, size=len(batch)).tolist(), batch, strict=True):
                ctx.update(token)
            timed("step", backend.step, batch)
        timed_each("release", backend.release, batch)
        yield


def interleaved(runs: list[Iterator[None]]) -> None:
    """Advances each run one batch at a time in turn, so both managers see the
    same stretches of a shared machine's load. What exists beforehand is
    collected and frozen, so neither pays for scanning the other's (or the
    imports') objects; garbage each makes itself still counts."""
    gc.collect()
    gc.freeze()
    try:
        for _ in zip(*runs, strict=True):
            pass
    finally:
        gc.unfreeze()


def both_managers(page_size: int, total_num_pages: int, max_batch_size: int) -> dict[str, Backend]:
    """mokv's manager and MAX's over caches of the same size, behind the reference package's
    common interface (`mokv_reference.manager_backends`)."""
    backends = reference("manager_backends", MAX_MANAGER)
    return {
        "mokv": backends.MokvBackend(page_size, total_num_pages, max_batch_size),
        "max": backends.MaxBackend(page_size, total_num_pages, max_batch_size),
    }


def run_case(case: Case, clock_name: str = "cpu") -> list[dict[str, Any]]:
    """Both managers on one case: one JSON row per operation plus the `request` row."""
    prompts = make_prompts(case)
    backends = both_managers(case.page_size, case.total_num_pages, case.batch_size)
    timings = {name: Timings() for name in backends}
    interleaved([trace(b, case, prompts, timings[name], clock_name=clock_name) for name, b in backends.items()])
    num_requests = case.num_batches * case.batch_size
    rows = []
    for op in OPS:
        mokv_us, max_us = (timings[k].per_call_us(op) for k in ("mokv", "max"))
        rows.append(_row(case, op, mokv_us, max_us, calls=timings["mokv"].calls[op]))
    mokv_req, max_req = (sum(timings[k].total_ns.values()) / num_requests / 1e3 for k in ("mokv", "max"))
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


def decode_steps(
    backend: Backend, batch_size: int, page_size: int, t: Timings, steps: int = 64, clock_name: str = "cpu"
) -> Iterator[None]:
    """A batch of `batch_size` prefilled 512-token requests decoding `steps`
    steps; each step's manager work (alloc for every request, runtime_inputs,
    step) is timed as `decode_step`. Yields after each step."""
    clock = CLOCKS[clock_name]
    overhead = clock_overhead_ns(clock)
    rng = np.random.default_rng(batch_size)
    batch = [backend.new_context(f"d{i}", rng.integers(0, _VOCAB, 512)) for i in range(batch_size)]
    for ctx in batch:
        backend.claim(ctx)
        backend.alloc(ctx)
    backend.runtime_inputs(batch)
    for ctx in batch:
        ctx.update(1)
    backend.step(batch)
    for _ in range(steps):
        start = clock()
        for ctx in batch:
            backend.alloc(ctx)
        backend.runtime_inputs(batch)
        elapsed = clock() - start
        for token, ctx in zip(rng.integers(0, _VOCAB, size=batch_size).tolist(), batch, strict=True):
            ctx.update(token)
        start = clock()
        backend.step(batch)
        t.total_ns["decode_step"] = t.total_ns.get("decode_step", 0) + elapsed + clock() - start - 2 * overhead
        t.calls["decode_step"] = t.calls.get("decode_step", 0) + 1
        yield
    for ctx in batch:
        backend.release(ctx)


def smollm2_step_ms(e2e_json: Path, batch: int) -> float | None:
    """SmolLM2's decode step time at `batch` from a `mokv bench e2e` result
    (`batch / decode tokens per second`, prefix caching off), if it has one."""
    if not e2e_json.is_file():
        return None
    for row in json.loads(e2e_json.read_text()):
        if row.get("batch") == batch and not row.get("prefix_caching") and row.get("decode_tokens_per_s"):
            return 1e3 * batch / row["decode_tokens_per_s"]
    return None


def decode_step_rows(batch_sizes: tuple[int, ...], e2e_json: Path, clock_name: str) -> list[dict[str, Any]]:
    """The manager's cost per decode step of a batch, both managers side by
    side, next to SmolLM2's step time where `mokv bench e2e` measured it."""
    rows = []
    page_size = 16
    for batch_size in batch_sizes:
        pages = 2 * batch_size * -(-(512 + 80) // page_size)
        backends = both_managers(page_size, pages, batch_size)
        timings = {name: Timings() for name in backends}
        interleaved(
            [decode_steps(b, batch_size, page_size, timings[n], clock_name=clock_name) for n, b in backends.items()]
        )
        mokv_us, max_us = (timings[n].per_call_us("decode_step") for n in ("mokv", "max"))
        model_ms = smollm2_step_ms(e2e_json, batch_size)
        case = Case(page_size, f"decode-b{batch_size}", 1, batch_size)
        rows.append(
            _row(
                case,
                "decode_step",
                mokv_us,
                max_us,
                calls=timings["mokv"].calls["decode_step"],
                smollm2_step_ms=None if model_ms is None else round(model_ms, 2),
                mokv_share_of_step=None if model_ms is None else round(mokv_us / 1e3 / model_ms, 5),
            )
        )
    return rows


def to_markdown(rows: list[dict[str, Any]], header: str) -> str:
    """The rows as a markdown table."""
    lines = [
        header,
        "",
        "| case | op | calls | mokv µs | MAX µs | speedup | hit rate mokv / MAX |",
        "|---|---|---:|---:|---:|---:|---|",
    ]
    trace_rows = [r for r in rows if r["op"] != "decode_step"]
    for r in trace_rows:
        hits = f"{r['mokv_hit_rate']:.4f} / {r['max_hit_rate']:.4f}" if r["op"] == "request" else ""
        lines.append(
            f"| {r['case']} | {r['op']} | {r['calls']} | {r['mokv_us']:.1f} | "
            f"{r['max_us']:.1f} | {r['speedup']:.1f}x | {hits} |"
        )
    requests = [r for r in trace_rows if r["op"] == "request"]
    if requests:
        worst = min(requests, key=lambda r: r["speedup"])
        lines += ["", f"Worst case per request: **{worst['speedup']:.1f}x** ({worst['case']})."]
    steps = [r for r in rows if r["op"] == "decode_step"]
    if steps:
        lines += [
            "",
            "Manager cost per decode step (alloc for every request, runtime_inputs, step; page 16, "
            "512-token contexts), next to SmolLM2-135M's decode step from `mokv bench e2e`:",
            "",
            "| batch | mokv µs | MAX µs | speedup | SmolLM2 step ms | mokv share of the step |",
            "|---:|---:|---:|---:|---:|---:|",
        ]
        for r in steps:
            model = "not measured" if r["smollm2_step_ms"] is None else f"{r['smollm2_step_ms']:.1f}"
            share = "" if r["mokv_share_of_step"] is None else f"{100 * r['mokv_share_of_step']:.2f}%"
            lines.append(
                f"| {r['case'].split('-b')[-1]} | {r['mokv_us']:.1f} | {r['max_us']:.1f} | "
                f"{r['speedup']:.1f}x | {model} | {share} |"
            )
    return "\n".join(lines) + "\n"


@click.command("manager")
@click.option("--quick", is_flag=True, help="Fewer batches per case (well under five minutes).")
@click.option(
    "--clock",
    "clock_name",
    type=click.Choice(sorted(CLOCKS)),
    default="cpu",
    show_default=True,
    help="cpu: this thread's CPU time (steadier on a shared machine); wall: elapsed time.",
)
@click.option(
    "--e2e",
    "e2e_json",
    type=click.Path(dir_okay=False, path_type=Path),
    default=Path("bench-results/e2e.json"),
    show_default=True,
    help="A `mokv bench e2e` result to read SmolLM2's step time from.",
)
@out_dir_option("manager")
def manager(quick: bool, clock_name: str, e2e_json: Path, out_dir: Path) -> None:
    """mokv's PagedKVCacheManager vs MAX 26.7's on the same request trace."""
    reference("manager_backends", MAX_MANAGER)  # stop early where it is missing
    num_batches = 4 if quick else 16
    cases = [Case(ps, kind, num_batches) for ps in (128, 16) for kind in ("shared", "random")]
    rows: list[dict[str, Any]] = []
    for case in cases:
        click.echo(f"{case.name}: {num_batches} batches of {case.batch_size} ...", err=True)
        rows += run_case(case, clock_name)
    click.echo("decode steps at batch 32 and 64 ...", err=True)
    rows += decode_step_rows((32, 64), e2e_json, clock_name)
    header = (
        "# mokv vs MAX PagedKVCacheManager\n\n"
        f"{num_batches} batches of 32 requests per case; 512-token prompts (`shared`: one of 4 "
        "384-token system prompts + 128 random tokens; `random`: all random), 64 decode steps, "
        "prefix caching on. µs per call; `runtime_inputs` and `step` are per batch (MAX 26.7's "
        "`step` takes one request, so its row times the loop over the batch); `request` is all "
        "manager calls per request, batch calls split over the batch. Both managers run in one "
        f"process, a batch each in turn; times are {clock_name} time ("
        + ("this thread's CPU time" if clock_name == "cpu" else "elapsed")
        + "), less what an empty timed region measures. "
        f"Host: {platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}."
    )
    markdown = to_markdown(rows, header)
    write_results(out_dir, "manager", rows, markdown)
