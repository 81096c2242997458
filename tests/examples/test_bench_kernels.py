"""`mokv bench kernels --against REV`: the kernels of a git revision are
rebuilt from git's copy and timed beside this checkout's, in one process."""

from __future__ import annotations

import json
from pathlib import Path

from click.testing import CliRunner

from mokv.kernels import _source_digest, kernel_source_dir
from mokv_examples.bench.revisions import kernel_sources_at
from mokv_examples.cli import main


def test_same_kernels_give_identical_outputs(tmp_path: Path):
    """Against HEAD with the kernels unchanged, both sides are one build: the
    outputs must agree bit for bit and the timing ratio must be a real one."""
    same_sources = _source_digest(kernel_sources_at("HEAD", tmp_path / "src")) == _source_digest(kernel_source_dir())
    result = CliRunner().invoke(
        main,
        [
            "bench",
            "kernels",
            "--against",
            "HEAD",
            "--only",
            "decode-float32-9x3x64-page16-b1-ctx512",
            "--seconds",
            "0.2",
            "--out",
            str(tmp_path / "out"),
        ],
    )
    assert result.exit_code == 0, result.output
    (row,) = json.loads((tmp_path / "out" / "kernels.json").read_text())
    assert row["case"] == "decode-float32-9x3x64-page16-b1-ctx512"
    assert row["mokv_s"] > 0 and row["against_s"] > 0
    assert abs(row["speedup"] - row["against_s"] / row["mokv_s"]) < 1e-12
    if same_sources:
        assert row["max_abs_diff"] == 0


def test_unknown_revision_is_named(tmp_path: Path):
    result = CliRunner().invoke(
        main, ["bench", "kernels", "--against", "no-such-revision", "--only", "ctx512", "--out", str(tmp_path)]
    )
    assert result.exit_code != 0
    assert "no-such-revision" in result.output
