"""The prepared GPU run (`tests/gpu/README.md`, "The prepared command") against what it
calls: a GPU is lent by chance for fifteen minutes, so a flag the proof does not take, a
setting it never reads, a file it cannot swap or a `-k` that selects no test must fail
here, not in a run. No GPU needed: the GPU tests collect on any machine."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
README = REPO / "tests" / "gpu" / "README.md"
PROOF = REPO / "tools" / "gpu_proof.sh"
PROOF_IGNORES = [word for pair in re.findall(r'(--ignore(?:-glob)?) "?([^\s"\\]+)', PROOF.read_text()) for word in pair]
"""The files the proof's tests step leaves out, as `tools/gpu_proof.sh` names them."""


def _prepared_calls() -> list[str]:
    """The shell commands of the `run(command="...")` calls after the prepared command's heading."""
    section = README.read_text().split("## The prepared command", 1)[1]
    return [m.replace('\\"', '"') for m in re.findall(r'run\(command="((?:[^"\\]|\\.)*)"', section)]


def _proof_calls() -> list[tuple[dict[str, str], list[str]]]:
    """Each call of the proof: its settings and its flags."""
    calls = []
    for command in _prepared_calls():
        words = shlex.split(command)
        if "tools/gpu_proof.sh" not in words:
            continue
        at = words.index("tools/gpu_proof.sh")
        settings = dict(word.split("=", 1) for word in words[:at])
        calls.append((settings, words[at + 1 :]))
    return calls


def _carried() -> list[str]:
    """The paths the prepared command's calls carry (`carry=[...]`), each once."""
    section = README.read_text().split("## The prepared command", 1)[1]
    carries = re.findall(r"carry=\[([^\]]*)\]", section)
    return sorted({path for carry in carries for path in re.findall(r'"([^"]+)"', carry)})


CALLS = _proof_calls()
SELECTING = [i for i, (settings, _) in enumerate(CALLS) if "-k" in shlex.split(settings.get("PYTEST_ARGS", ""))]


def test_the_prepared_run_has_its_calls():
    assert len(_prepared_calls()) >= 3 and len(CALLS) >= 3 and len(SELECTING) >= 2


@pytest.mark.parametrize("call", range(len(CALLS)))
def test_each_flag_and_setting_is_one_the_proof_reads(call: int):
    settings, flags = CALLS[call]
    proof = PROOF.read_text()
    for flag in flags:
        assert f"        {flag})" in proof, f"tools/gpu_proof.sh takes no {flag}"
    for name in settings:
        assert f"${{{name}" in proof or f"${name}" in proof, f"tools/gpu_proof.sh never reads {name}"
    for pair in settings.get("COMPARE", "").replace(",", " ").split():
        target, _, source = pair.partition("=")
        assert (REPO / target).exists(), f"COMPARE swaps {target}, which is not in the repository"
        assert source.split("/")[0] in (REPO / "tools" / "gpu_previous.sh").read_text(), source


@pytest.mark.parametrize("call", SELECTING)
def test_each_test_selection_selects_tests(call: int):
    given = shlex.split(CALLS[call][0]["PYTEST_ARGS"])
    expression = f"not emulated and ({given[given.index('-k') + 1]})"
    command = [sys.executable, "-m", "pytest", "tests/gpu", "--collect-only", "-q", "-p", "no:cacheprovider"]
    result = subprocess.run(
        [*command, *PROOF_IGNORES, "-k", expression],
        cwd=REPO,
        capture_output=True,
        text=True,
        env=dict(os.environ),  # the environment this process started with (see mokv.kernels)
        timeout=600,
        check=False,
    )
    selected = [line for line in result.stdout.splitlines() if "::" in line]
    assert result.returncode == 0 and selected, f"-k {expression!r} selects no GPU test:\n{result.stdout[-2000:]}"


@pytest.mark.parametrize("path", _carried())
def test_each_carried_path_is_made_by_a_tool_and_used_there(path: str):
    # Carried paths are git-ignored (otherwise they would travel anyway), made here by one
    # of the tools, and read there: by the proof itself or through a call's COMPARE.
    ignored = subprocess.run(["git", "check-ignore", "-q", f"{path}/x"], cwd=REPO, check=False)
    assert ignored.returncode == 0, f"{path} is carried but not git-ignored"
    makers = [
        t.name
        for t in (REPO / "tools").glob("*.sh")
        if t != PROOF and re.search(rf"(?<![\w.-]){re.escape(path)}(?![\w-])", t.read_text())
    ]
    assert makers, f"no tool makes {path}"
    compared = " ".join(settings.get("COMPARE", "") for settings, _ in CALLS)
    assert path in PROOF.read_text() or path in compared, f"nothing reads {path} on the GPU machine"


def test_the_host_cpu_pin_reaches_every_python_process_of_the_site(tmp_path: Path):
    # The carried kernels' host side was compiled for a named CPU, which MAX's cache key
    # holds: the proof pins the GPU machine's Python to it (tools/pin_host_cpu.sh), so a
    # process that starts there must compile for that CPU before it compiles anything.
    pin = REPO / "tools" / "pin_host_cpu.sh"

    def started(code: str, *flags: str) -> subprocess.CompletedProcess[str]:
        """A new interpreter whose site directory is `tmp_path`, running `code`."""
        command = f"import site; site.addsitedir({str(tmp_path)!r}); {code}"
        return subprocess.run([sys.executable, *flags, "-c", command], capture_output=True, text=True, check=True)

    subprocess.run([pin, tmp_path, "x86-64-v3"], check=True)
    pinned = started("from max import driver; print(driver.get_virtual_cpu_target())")
    assert pinned.stdout.strip() == "x86-64-v3", pinned.stderr
    # Where MAX is not importable (-S: no site-packages) the pin does nothing, quietly.
    bare = started("print('started')", "-S")
    assert bare.stdout.strip() == "started" and not bare.stderr, bare.stderr
    # An empty name removes it; a name that is not one is refused before anything is written.
    subprocess.run([pin, tmp_path, ""], check=True)
    assert not list(tmp_path.iterdir())
    refused = subprocess.run([pin, tmp_path, "x86-64-v3'); import os; os.remove('x"], capture_output=True, text=True)
    assert refused.returncode == 2 and "not an LLVM CPU name" in refused.stderr
    assert not list(tmp_path.iterdir())
