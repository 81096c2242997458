"""Where `mokv bench` commands leave their results, and the ratio summaries their tables open
with: one `--out` option and one writer, so every benchmark writes `<name>.json` and
`<name>.md` side by side."""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import click

F = TypeVar("F", bound=Callable[..., Any])


def out_dir_option(name: str) -> Callable[[F], F]:
    """The `--out DIR` option of benchmark `name` (passed as `out_dir`)."""
    return click.option(
        "--out",
        "out_dir",
        type=click.Path(file_okay=False, path_type=Path),
        default=Path("bench-results"),
        show_default=True,
        help=f"Where {name}.json and {name}.md go.",
    )


def write_results(out_dir: Path, name: str, rows: list[dict[str, Any]], markdown: str) -> None:
    """Writes the rows as JSON and the markdown table, and prints the table."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{name}.json").write_text(json.dumps(rows, indent=2) + "\n")
    (out_dir / f"{name}.md").write_text(markdown)
    click.echo(markdown)
    click.echo(f"wrote {out_dir / name}.json and {out_dir / name}.md", err=True)


def span(values: list[float]) -> str:
    """Min, median and max of a ratio over the cases it covers, and how many there are."""
    if not values:
        return "no cases"
    cases = f"{len(values)} case" + ("s" if len(values) > 1 else "")
    return f"min {min(values):.2f}, median {statistics.median(values):.2f}, max {max(values):.2f} ({cases})"
