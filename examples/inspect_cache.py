"""`mokv inspect`: a picture of the paged cache at its fullest moment: which
pages each request holds, and which of them it shares with others through the
prefix cache."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import click
import numpy as np

from mokv import PagedKVCacheManager
from mokv_examples.options import tier_options
from mokv_examples.pipeline import GenerationConfig, SmolLM2, generate
from mokv_examples.prompts import QUESTIONS, system_chat
from mokv_examples.scheduler import Scheduler


@dataclass
class PageSnapshot:
    """Which pages each running request held at one step."""

    step: int
    request_ids: list[str]
    pages: list[list[int]]
    """Each request's page ids, in order (MAX's `get_req_blocks`)."""

    @classmethod
    def take(cls, scheduler: Scheduler) -> PageSnapshot:
        ids = [r.request_id for r in scheduler.running]
        return cls(scheduler.stats.steps, ids, [scheduler.manager.get_req_blocks(i) for i in ids])

    @property
    def num_pages_held(self) -> int:
        return len({page for pages in self.pages for page in pages})

    def sharing(self) -> dict[int, int]:
        """Page id -> number of requests holding it."""
        ids, counts = np.unique(np.concatenate([np.asarray(p, int) for p in self.pages]), return_counts=True)
        return dict(zip(ids.tolist(), counts.tolist(), strict=True))


def draw(snapshot: PageSnapshot, path: Path) -> None:
    """Page-occupancy grid (requests x pages; shared pages stand out) and a bar
    chart of shared vs private pages per request."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sharing = snapshot.sharing()
    pages = sorted(sharing)
    column = {page: i for i, page in enumerate(pages)}
    grid = np.zeros((len(snapshot.request_ids), len(pages)))
    for row, held in enumerate(snapshot.pages):
        for page in held:
            grid[row, column[page]] = 2 if sharing[page] > 1 else 1
    fig, (ax_grid, ax_bars) = plt.subplots(
        1, 2, figsize=(13, 0.5 * len(snapshot.request_ids) + 2.5), gridspec_kw={"width_ratios": [3, 1]}
    )
    cmap = matplotlib.colors.ListedColormap(["#f4f4f4", "#7fa7d6", "#e4572e"])
    ax_grid.imshow(grid, aspect="auto", cmap=cmap, vmin=0, vmax=2, interpolation="nearest")
    ax_grid.set_yticks(range(len(snapshot.request_ids)), snapshot.request_ids)
    step = max(1, len(pages) // 16)
    ax_grid.set_xticks(range(0, len(pages), step), [pages[i] for i in range(0, len(pages), step)])
    ax_grid.set_xlabel("page id (held pages only)")
    ax_grid.set_title(f"pages held at step {snapshot.step}: blue private, red shared via prefix cache")
    shared = [sum(sharing[page] > 1 for page in held) for held in snapshot.pages]
    private = [len(held) - s for held, s in zip(snapshot.pages, shared, strict=True)]
    y = np.arange(len(snapshot.request_ids))
    ax_bars.barh(y, shared, color="#e4572e", label="shared")
    ax_bars.barh(y, private, left=shared, color="#7fa7d6", label="private")
    ax_bars.set_yticks(y, [])
    ax_bars.invert_yaxis()
    ax_bars.set_xlabel("pages")
    ax_bars.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def fullest_snapshot(model: SmolLM2, config: GenerationConfig) -> tuple[PageSnapshot, PagedKVCacheManager]:
    """Answers the first question alone (its pages enter the prefix cache), then
    the rest together on the same cache; returns the step of the second run
    that held the most pages, and the manager (shut down: its tiers have
    stored everything)."""
    prompts = [system_chat(model.tokenizer, q) for q in QUESTIONS]
    fullest: list[PageSnapshot] = []

    def keep_fullest(scheduler: Scheduler) -> None:
        snapshot = PageSnapshot.take(scheduler)
        if not fullest or snapshot.num_pages_held > fullest[0].num_pages_held:
            fullest[:] = [snapshot]

    _, _, manager = generate(model, prompts[:1], config)
    generate(model, prompts[1:], config, on_step=keep_fullest, manager=manager)
    manager.shutdown()
    return fullest[0], manager


def tier_lines(manager: PagedKVCacheManager) -> list[str]:
    """One line per tier: the device pool, then each lower tier's occupancy."""
    lines = [f"  device: {manager.get_num_used_pages()}/{manager.total_num_pages} pages held by requests"]
    metrics = manager.get_tier_metrics()
    for name, usage in manager.get_tier_usage().items():
        total = f"/{usage.total_pages}" if usage.total_pages else ""
        budget = f" of {usage.total_bytes / 1e6:.1f}" if usage.total_bytes else ""
        m = metrics[name]
        lines.append(
            f"  {name}: {usage.used_pages}{total} pages, {usage.used_bytes / 1e6:.1f}{budget} MB; "
            f"{m.hit_pages} pages served, {m.saved_pages} stored, {m.rejected_pages} rejected"
        )
    return lines


@click.command("inspect")
@click.option(
    "--out", type=click.Path(dir_okay=False, path_type=Path), default=Path("bench-results/cache.png"), show_default=True
)
@click.option("--page-size", default=16, show_default=True)
@click.option("--max-new-tokens", default=24, show_default=True)
@tier_options
def inspect_cache(
    out: Path,
    page_size: int,
    max_new_tokens: int,
    host_cache_pages: int,
    disk_cache: str | None,
    remote_cache: str | None,
) -> None:
    """Run a shared-system-prompt workload, draw the cache at its fullest, and
    show each tier's occupancy."""
    tiers = {"host_pages": host_cache_pages, "disk_cache": disk_cache, "remote_cache": remote_cache}
    config = GenerationConfig(max_new_tokens=max_new_tokens, page_size=page_size, num_pages=256, **tiers)
    snapshot, manager = fullest_snapshot(SmolLM2(), config)
    hit_rate = manager.get_metrics_aggregated().cache_hit_rate
    out.parent.mkdir(parents=True, exist_ok=True)
    draw(snapshot, out)
    sharing = snapshot.sharing()
    click.echo(
        f"step {snapshot.step}: {len(snapshot.request_ids)} requests hold {len(sharing)} distinct pages, "
        f"{sum(c > 1 for c in sharing.values())} of them shared; prefix hit rate {hit_rate:.1%}; wrote {out}"
    )
    click.echo("tiers after the run:\n" + "\n".join(tier_lines(manager)))
