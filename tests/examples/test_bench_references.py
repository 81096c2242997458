"""Benchmarks that need mokv's reference package (MAX's own manager, kernels and cache) say
how to get it where it is missing, and the `mokv` command works without it."""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
from pathlib import Path

import click
import pytest

from mokv_examples.bench.references import reference


class NotInstalled:
    """An import finder that finds no `mokv_reference`, as where it is not installed."""

    def find_spec(self, name: str, path: object = None, target: object = None) -> None:
        if name.split(".")[0] == "mokv_reference":
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)


MISSING_REFERENCE = (
    "import json, sys\n"
    + inspect.getsource(NotInstalled)
    + """
sys.meta_path.insert(0, NotInstalled())
from click.testing import CliRunner
from mokv_examples.cli import main
results = []
for args in json.loads(sys.argv[1]):
    result = CliRunner().invoke(main, args)
    results.append({"args": args, "exit_code": result.exit_code, "output": result.output})
print(json.dumps(results))
"""
)
"""Runs `mokv` with each argument list of `sys.argv[1]` (JSON) in a fresh interpreter where
`mokv_reference` cannot be imported; prints each run's exit code and output."""


def test_reference_names_the_missing_module_and_how_to_install_it(monkeypatch):
    for name in [m for m in sys.modules if m.startswith("mokv_reference.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.delitem(sys.modules, "mokv_reference", raising=False)
    monkeypatch.setattr(sys, "meta_path", [NotInstalled(), *sys.meta_path])
    with pytest.raises(click.ClickException) as error:
        reference("manager_backends", "the benchmark compares with MAX")
    message = error.value.message
    assert message.startswith("the benchmark compares with MAX: it comes from mokv's reference package")
    assert "(No module named 'mokv_reference')" in message and "`make setup`" in message
    assert "`pip install -e <checkout>/reference 'max[serve]==26.7.0'`" in message


def test_reference_returns_the_module_where_it_is_installed():
    module = reference("manager_backends", "unused")
    assert module.__name__ == "mokv_reference.manager_backends" and hasattr(module, "MaxBackend")


def test_cli_without_the_reference_package(tmp_path: Path):
    """In a fresh interpreter where mokv_reference cannot be imported: the help texts work, and
    each benchmark that needs it stops with the install message before doing any work."""
    out = tmp_path / "out"
    needing = {
        "manager": ["bench", "manager", "--quick", "--out", str(out)],
        "attention": ["bench", "attention", "--quick", "--out", str(out)],
        "e2e": ["bench", "e2e", "--quick", "--out", str(out)],
        "kernels": ["bench", "kernels", "--against", "HEAD", "--quick", "--out", str(out)],
    }
    runs = [["--help"], ["bench", "--help"], *needing.values()]
    process = subprocess.run(
        [sys.executable, "-c", MISSING_REFERENCE, json.dumps(runs)],
        capture_output=True,
        text=True,
        env=dict(os.environ),
        timeout=300,
        check=True,
    )
    help_run, bench_help, *failed = json.loads(process.stdout.strip().splitlines()[-1])
    assert help_run["exit_code"] == 0 and "bench" in help_run["output"]
    assert bench_help["exit_code"] == 0 and all(name in bench_help["output"] for name in needing)
    for name, result in zip(needing, failed, strict=True):
        assert result["exit_code"] == 1, result
        purpose, _, _ = result["output"].partition(": it comes from mokv's reference package")
        assert purpose.startswith("Error: ") and f"mokv bench {name}" in purpose, result
        assert "(No module named 'mokv_reference')" in result["output"], result
        assert "`make setup`" in result["output"] and "<checkout>/reference" in result["output"], result
    assert not out.exists(), "a benchmark wrote results before stopping"
