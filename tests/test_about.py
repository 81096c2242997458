"""`python -m mokv` and `mokv --version`: the versions in use and where the kernels and
caches are, as a bug report needs them."""

from __future__ import annotations

import os
import subprocess
import sys
from importlib.metadata import version

from click.testing import CliRunner

from mokv.about import report
from mokv.kernels import kernel_sources_root
from mokv.paths import cache_dir, precompiled_kernels_dir
from mokv_examples.cli import main


def test_report_names_versions_and_folders():
    text = report()
    for line in (
        f"mokv {version('mokv')} ",
        f"MAX {version('max')}",
        f"Mojo {version('mojo')} ",
        f"kernel sources: {kernel_sources_root()} (mokv_kernels",
        f"mokv cache: {cache_dir()} (from $MOKV_CACHE_DIR)",
        f"  precompiled kernels: {precompiled_kernels_dir()}",
        "compiled graphs: ",
    ):
        assert line in text, f"{line!r} missing from:\n{text}"


def test_python_m_mokv_and_mokv_version_print_the_report():
    # os.environ, not the C-level environment that importing MAX altered (see mokv.kernels).
    module = subprocess.run(
        [sys.executable, "-m", "mokv"], capture_output=True, text=True, env=dict(os.environ), check=True
    )
    assert module.stdout.strip() == report()
    result = CliRunner().invoke(main, ["--version"])
    assert result.exit_code == 0, result.output
    assert result.output.strip() == report()
