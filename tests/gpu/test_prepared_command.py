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
import sysconfig
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
        result = subprocess.run(
            [sys.executable, *flags, "-c", command],
            env=dict(os.environ),  # the environment this process started with (see mokv.kernels)
            capture_output=True,
            text=True,
            check=False,
        )
        assert result.returncode == 0, result.stderr
        return result

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


def _proof_function(name: str) -> str:
    """A shell function of the proof, as `tools/gpu_proof.sh` defines it."""
    found = re.search(rf"^{name}\(\) \{{.*?^\}}", PROOF.read_text(), re.S | re.M)
    assert found, f"tools/gpu_proof.sh defines no {name}()"
    return found.group(0)


def test_the_proofs_install_pins_a_bare_interpreter_to_the_carried_kernels_cpu(tmp_path: Path):
    # The proof's install step in a directory laid out as the GPU machine's: a bare
    # interpreter whose site-packages gets the pin, MAX found beside it (there through
    # PYTHONPATH), the wheels installed already; its new processes must then compile for
    # the CPU the archive names, and for the machine's own with HOST_CPU set empty.
    checkout = tmp_path / "checkout"
    (checkout / ".gpu-warm").mkdir(parents=True)
    (checkout / "tools").symlink_to(REPO / "tools")
    (checkout / ".gpu-warm" / "host-cpu").write_text("x86-64-v3\n")
    bare = tmp_path / "bare"
    # The environment this process started with (see mokv.kernels).
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", bare], env=dict(os.environ), check=True)
    bare_site = next((bare / "lib").glob("python*/site-packages"))
    (bare_site / "max_beside.pth").write_text(sysconfig.get_path("purelib") + "\n")
    site = tmp_path / "site"
    site.mkdir()
    (site / ".installed").touch()
    environment = {
        **os.environ,
        "PATH": f"{bare / 'bin'}{os.pathsep}{os.environ['PATH']}",
        "SITE": str(site),
        "MOKV_CACHE_DIR": str(tmp_path / "cache"),
        "MODULAR_CACHE_DIR": str(tmp_path / "cache" / "modular"),
    }

    def install(**settings: str) -> str:
        script = f"{_proof_function('install')}\ninstall"
        result = subprocess.run(
            ["bash", "-c", script], cwd=checkout, env={**environment, **settings}, capture_output=True, text=True
        )
        assert result.returncode == 0, result.stdout + result.stderr
        return result.stdout

    assert "host side of the kernels compiled for: x86-64-v3" in install()
    assert (bare_site / "mokv_host_cpu.pth").exists()
    assert "host side of the kernels compiled for: the processor here" in install(HOST_CPU="")
    assert not (bare_site / "mokv_host_cpu.pth").exists()


def test_each_step_counts_what_it_compiled_by_kind(tmp_path: Path):
    # Entries of MAX's kernel cache newer than the step's start are compiles that did not
    # find their result: ELF for CUDA (machine code 190), for x86-64 (62), anything else IR.
    cache = tmp_path / "modular" / ".mojo_cache" / "mojo" / "transform" / "v"
    cache.mkdir(parents=True)

    def entry(name: str, machine: int | None) -> None:
        header = b"\x7fELF" + bytes(14) + machine.to_bytes(2, "little") if machine else b"ML\xefR" + bytes(16)
        (cache / name).write_bytes(header + bytes(64))

    stamp = tmp_path / "stamp"
    stamp.touch()
    os.utime(stamp, (1000, 1000))
    for name, machine, written in (
        ("old", 190, 0),
        ("a", 190, 2000),
        ("b", 190, 2000),
        ("c", 62, 2000),
        ("d", None, 2000),
    ):
        entry(name, machine)
        os.utime(cache / name, (written, written))
    script = f'{_proof_function("compiled_since")}\ncompiled_since "{stamp}"'
    environment = {**os.environ, "MODULAR_CACHE_DIR": str(tmp_path / "modular")}
    result = subprocess.run(["bash", "-c", script], env=environment, capture_output=True, text=True, check=True)
    assert result.stdout.strip().endswith(": 2 GPU kernels, 1 host objects, 1 IR libraries"), result.stdout
