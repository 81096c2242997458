"""mokv used the way another project uses it: the README's "Use mokv in your project"
commands build a sdist and a wheel, install the wheel into a fresh virtualenv outside the
checkout and print where its kernels and caches are; the README's graph example then runs
there, on the installed package alone, and matches numpy.

The new virtualenv installs from the wheelhouse that `make wheels` fills (what `make test`
does first), with pip's index turned off, so the test never needs the network.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import numpy as np
import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name, parse_wheel_filename

from mokv.paths import CACHE_ENV, MODULAR_CACHE_ENV, cache_dir
from mokv_reference.attention import causal_attention
from tests.support.readme import readme_example

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
RESULT = "attend.npz"
# Appended to the README's example: what the test checks, and which mokv ran it.
SAVE_RESULT = f"""
import mokv
print("mokv imported from", mokv.__file__)
np.savez({RESULT!r}, q=q, k=k, v=v, out=out.to_numpy())
"""


def wheelhouse() -> Path:
    """Where `make wheels` downloads what installing mokv's wheel needs."""
    return cache_dir() / "wheels"


def user_cache() -> Path:
    """XDG_CACHE_HOME of the downstream project."""
    return cache_dir() / "packaging-test-user"


def missing_from_wheelhouse() -> list[str]:
    """The pins of requirements.txt, and the build backend, that the wheelhouse lacks."""
    present = [parse_wheel_filename(wheel.name)[:2] for wheel in wheelhouse().glob("*.whl")]
    wanted = [
        Requirement(line)
        for line in (REPO / "requirements.txt").read_text().splitlines()
        if line and not line.startswith("#")
    ]
    wanted.append(Requirement("setuptools>=68"))
    return [
        str(req)
        for req in wanted
        if not any(name == canonicalize_name(req.name) and req.specifier.contains(version) for name, version in present)
    ]


def readme_commands() -> str:
    section = README.read_text().split("## Use mokv in your project", 1)[1].split("\n## ", 1)[0]
    match = re.search(r"```bash\n(.*?)```", section, re.DOTALL)
    assert match, "the README's 'Use mokv in your project' section has no bash block"
    return match.group(1)


@pytest.fixture(scope="module")
def project(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """A downstream project outside the checkout after the README's commands ran in it:
    its folder, its environment, and what the commands printed."""
    missing = missing_from_wheelhouse()
    if missing:
        pytest.skip(
            f"the wheelhouse {wheelhouse()} lacks {', '.join(missing)}, which a fresh install of mokv "
            f"needs without the network: run `make wheels` (make test does)"
        )
    folder = tmp_path_factory.mktemp("downstream")
    env = {k: v for k, v in os.environ.items() if k not in (CACHE_ENV, "PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env.update(
        MOKV_CHECKOUT=str(REPO),
        # The project's tools first, as in an activated environment: pip, build, python3.11.
        PATH=f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}",
        PIP_NO_INDEX="1",
        PIP_FIND_LINKS=str(wheelhouse()),
        # A user cache of its own, where the installed mokv caches by default
        # (XDG_CACHE_HOME/mokv). It outlives the run, like a user's, because MAX keys
        # compiled graphs on the precompiled kernels' path: a rerun loads the graph the
        # last run compiled into the suite's MAX cache instead of compiling it again.
        XDG_CACHE_HOME=str(user_cache()),
        MODULAR_CACHE_DIR=os.environ[MODULAR_CACHE_ENV],
    )
    run = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", readme_commands()],
        cwd=folder,
        env=env,
        capture_output=True,
        text=True,
        check=False,
        timeout=540,
    )
    assert run.returncode == 0, f"the README's commands failed:\n{run.stdout}\n{run.stderr}"
    return {"folder": folder, "env": env, "stdout": run.stdout}


def mojo_sources() -> list[str]:
    """Every Mojo source of every package under the checkout's mojo/, sub-packages included."""
    return sorted(p.relative_to(REPO / "mojo").as_posix() for p in (REPO / "mojo").rglob("*.mojo"))


def test_sdist_and_wheel_carry_every_mojo_package(project: dict):
    (sdist,) = (project["folder"] / "dist").glob("mokv-*.tar.gz")
    (wheel,) = (project["folder"] / "dist").glob("mokv-*.whl")
    with tarfile.open(sdist) as archive:
        in_sdist = sorted(
            name.split("/python/mokv/mojo/", 1)[1]
            for name in archive.getnames()
            if "/python/mokv/mojo/" in name and name.endswith(".mojo")
        )
    with zipfile.ZipFile(wheel) as archive:
        in_wheel = sorted(name.removeprefix("mokv/mojo/") for name in archive.namelist() if name.endswith(".mojo"))
    assert in_sdist == mojo_sources()
    assert in_wheel == mojo_sources()


def test_wheel_ships_the_library_the_models_and_the_command_only(project: dict):
    """The references MAX's own cache is compared through, and the tests, stay in the checkout."""
    (wheel,) = (project["folder"] / "dist").glob("mokv-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        top_level = {
            name.split("/", 1)[0] for name in archive.namelist() if not name.split("/", 1)[0].endswith(".dist-info")
        }
    assert top_level == {"mokv", "mokv_models", "mokv_examples"}


def test_python_m_mokv_names_the_installed_kernels_and_the_user_cache(project: dict):
    folder, report = project["folder"], project["stdout"]
    site_packages = next((folder / ".venv" / "lib").glob("python3.*/site-packages"))
    assert re.search(r"^mokv \d+\.\d+\.\d+ ", report, re.MULTILINE), report
    assert "MAX 26.7.0" in report and "Mojo 1.2.0" in report, report
    assert f"kernel sources: {site_packages / 'mokv' / 'mojo'} (mokv_kernels" in report, report
    assert f"mokv cache: {user_cache() / 'mokv'} " in report, report


def test_readme_graph_runs_on_the_installed_package_and_matches_numpy(project: dict):
    folder = project["folder"]
    (folder / "attend.py").write_text(readme_example() + SAVE_RESULT)
    run = subprocess.run(
        [str(folder / ".venv" / "bin" / "python"), "attend.py"],
        cwd=folder,
        env=project["env"],
        capture_output=True,
        text=True,
        check=False,
        timeout=540,
    )
    assert run.returncode == 0, f"the downstream script failed:\n{run.stdout}\n{run.stderr}"
    assert f"mokv imported from {folder / '.venv'}" in run.stdout
    # The installed sources were precompiled into the user's cache (on a rerun, the same
    # sources found their package there), not into the checkout's.
    assert list((user_cache() / "mokv" / "mojo").glob("*/mokv_kernels.mojoc")), run.stderr
    result = np.load(folder / RESULT)
    expected = causal_attention(result["q"], result["k"], result["v"], scale=1 / np.sqrt(result["q"].shape[-1]))
    np.testing.assert_allclose(result["out"], expected, rtol=1e-4, atol=1e-5)


def test_the_mokv_command_without_the_cli_extra_names_the_extra(project: dict):
    mokv = project["folder"] / ".venv" / "bin" / "mokv"
    version = subprocess.run([mokv, "--version"], env=project["env"], capture_output=True, text=True, check=False)
    assert version.returncode == 0, version.stderr
    assert "kernel sources: " in version.stdout
    generate = subprocess.run([mokv, "generate", "hi"], env=project["env"], capture_output=True, text=True, check=False)
    assert generate.returncode != 0
    assert "pip install 'mokv[cli]'" in generate.stderr, generate.stderr
