"""`mokv bench weights --against REV`: the weight kernels of a git revision are rebuilt
from git's copy and timed beside this checkout's, on the same inputs."""

from __future__ import annotations

import json
from pathlib import Path

from click.testing import CliRunner

from mokv.kernels import _source_digest, kernel_source_dir
from mokv_examples.bench.revisions import kernel_sources_at
from mokv_examples.cli import main
from mokv_models.weight_formats import QUANT_KERNELS


def test_weights_against_a_revision_times_both_builds(tmp_path: Path):
    """Against HEAD with the kernels unchanged, both builds compute the same products: the
    same error against float64, and each timed."""
    at_head = kernel_sources_at("HEAD", tmp_path / "src", QUANT_KERNELS)
    assert at_head.name == QUANT_KERNELS
    same_sources = _source_digest(at_head) == _source_digest(kernel_source_dir(QUANT_KERNELS))
    args = ["--tokens", "1", "--candidates", "gguf", "--rounds", "1", "--against", "HEAD"]
    result = CliRunner().invoke(main, ["bench", "weights", *args, "--out", str(tmp_path / "out")])
    assert result.exit_code == 0, result.output
    rows = {row["candidate"]: row for row in json.loads((tmp_path / "out" / "weights.json").read_text())}
    assert set(rows) == {"gguf", "gguf@HEAD"}
    assert all(row["ms"] > 0 and row["relative_error"] < 1e-2 for row in rows.values())
    if same_sources:
        assert rows["gguf"]["relative_error"] == rows["gguf@HEAD"]["relative_error"]
