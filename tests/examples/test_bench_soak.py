"""`mokv bench soak`: a short run through the CLI passes its bounds and writes its results."""

from __future__ import annotations

import json
from pathlib import Path

from click.testing import CliRunner

from mokv_examples.bench.soak import SoakConfig, failures, run_soak
from mokv_examples.cli import main


def test_short_soak_writes_results(tmp_path: Path) -> None:
    result = CliRunner().invoke(main, ["bench", "soak", "--requests", "1500", "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    (row,) = json.loads((tmp_path / "soak.json").read_text())
    assert row["requests"] == 1500 and row["pages_in_use_at_end"] == 0
    assert row["d2h_blocks_copied"] > 0 and row["h2d_blocks_copied"] > 0 and row["cache_hit_rate"] > 0.5
    assert (tmp_path / "soak.md").read_text().count("passed") == 1 and (tmp_path / "soak.png").stat().st_size


def test_a_broken_bound_is_reported() -> None:
    result = run_soak(SoakConfig(requests=200, max_growth_mib=0.0), progress=False)
    result["rss_growth_mib"] = 0.5  # as a leak would show
    result["pages_in_use_at_end"] = 3
    assert [f.split()[0] for f in failures(result)] == ["resident", "3"]
