"""The dependency lists cannot drift apart: pyproject's dependencies and extras, the
pinned requirements files, constraints.txt and pixi.toml name the same packages, and
every pin satisfies pyproject's range."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

REPO = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
# Each pinned file pins one of pyproject's lists and includes the file that list builds
# on: an extra adds to the library, and `test` names `mokv[cli,remote]` to add to both.
PINNED_FILES = {
    "requirements.txt": (PYPROJECT["dependencies"], [], None),
    "requirements-cli.txt": (PYPROJECT["optional-dependencies"]["cli"], ["requirements.txt"], None),
    "requirements-remote.txt": (PYPROJECT["optional-dependencies"]["remote"], ["requirements.txt"], None),
    "requirements-test.txt": (
        PYPROJECT["optional-dependencies"]["test"],
        ["requirements-cli.txt", "requirements-remote.txt"],
        "mokv[cli,remote]",
    ),
}


def pinned(file: str) -> tuple[dict[str, Requirement], list[str]]:
    """The requirements one file pins itself, by canonical name, and the files it includes."""
    own: dict[str, Requirement] = {}
    included = []
    for line in (REPO / file).read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line.startswith("-r "):
            included.append(line.removeprefix("-r ").strip())
        elif line:
            req = Requirement(line)
            assert canonicalize_name(req.name) not in own, f"{file} pins {req.name} twice"
            own[canonicalize_name(req.name)] = req
    return own, included


def exact_version(req: Requirement, where: str) -> str:
    (spec,) = req.specifier
    assert spec.operator == "==", f"{where}: {req} is not an exact pin"
    return spec.version


@pytest.mark.parametrize("file", PINNED_FILES)
def test_each_requirements_file_pins_its_pyproject_list(file: str):
    declared, includes, builds_on = PINNED_FILES[file]
    by_name = {canonicalize_name(Requirement(r).name): Requirement(r) for r in declared}
    assert str(by_name.pop("mokv", None)) == str(builds_on)
    own, included = pinned(file)
    assert included == includes, f"{file} should include {includes}"
    assert sorted(own) == sorted(by_name), f"{file} and pyproject's list name different packages"
    for name, req in own.items():
        assert req.extras == by_name[name].extras, f"{file}: {req} and pyproject's {by_name[name]} differ in extras"
        version = exact_version(req, file)
        assert by_name[name].specifier.contains(version), f"{file} pins {req}, outside pyproject's {by_name[name]}"


def test_constraints_agree_with_every_pin():
    constraints = {}
    for line in (REPO / "constraints.txt").read_text().splitlines():
        if line and not line.startswith("#"):
            req = Requirement(line)
            constraints[canonicalize_name(req.name)] = exact_version(req, "constraints.txt")
    for file in PINNED_FILES:
        for name, req in pinned(file)[0].items():
            pin = constraints.get(name)
            assert pin == exact_version(req, file), f"{file} pins {req}; constraints.txt has {pin}"


def test_pixi_installs_exactly_the_pinned_packages():
    pixi = tomllib.loads((REPO / "pixi.toml").read_text())["pypi-dependencies"]
    assert pixi.pop("mokv") == {"path": ".", "editable": True}
    # The references, as make setup installs them: tests and benchmarks only.
    assert pixi.pop("mokv-reference") == {"path": "reference", "editable": True}
    expected: dict[str, tuple[str, set[str]]] = {}
    for file in PINNED_FILES:
        for name, req in pinned(file)[0].items():
            version, extras = expected.get(name, (exact_version(req, file), set()))
            assert version == exact_version(req, file), f"{req.name} is pinned at two versions"
            expected[name] = (version, extras | req.extras)
    found = {}
    for name, entry in pixi.items():
        spec = entry if isinstance(entry, str) else entry["version"]
        extras = set() if isinstance(entry, str) else set(entry.get("extras", []))
        found[canonicalize_name(name)] = (spec.removeprefix("=="), extras)
    assert found == expected, "pixi.toml's [pypi-dependencies] differ from the requirements files' pins"
