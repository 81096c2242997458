"""mokv's modules import downwards only, in the direction of the architecture
map: params, then buffers, then the verified prefix index and hashing (shared
by the device pool and every tier), the tiers, the paged cache's parts from
the page pool up to the replica, and the manager on top. Read from the source
with `ast`, so a wrong-way import fails here even when nothing executes it."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import mokv

PACKAGE = Path(mokv.__file__).parent

LAYERS: list[list[str]] = [
    ["mokv.validation", "mokv.paths", "mokv.metrics", "mokv.context"],
    ["mokv.params"],
    ["mokv.buffer", "mokv.contract", "mokv.kernels", "mokv.about"],
    ["mokv.graph"],
    ["mokv.prefix"],
    ["mokv.tiers"],
    ["mokv.paged.page_pool", "mokv.paged.page_table", "mokv.paged.request_state"],
    ["mokv.paged.prefix_lookup", "mokv.paged.input_plan", "mokv.paged.memory"],
    ["mokv.paged.commit", "mokv.paged.runtime_inputs"],
    ["mokv.paged.replica"],
    ["mokv.paged.batch_resolution", "mokv.paged.reservation"],
    ["mokv.paged.queries"],
    ["mokv.paged.manager", "mokv.continuous"],
    ["mokv.paged"],  # the package's own __init__, which exports the manager
]
"""Bottom first. A module may import its own layer and the ones below it;
modules not named here (the package root, the command line, integrations)
sit above them all."""


def layer(module: str) -> int:
    """The layer of `module`: that of the longest name in `LAYERS` it is or lies under."""
    best, best_len = len(LAYERS), -1
    for i, names in enumerate(LAYERS):
        for name in names:
            if (module == name or module.startswith(name + ".")) and len(name) > best_len:
                best, best_len = i, len(name)
    return best


def module_name(path: Path) -> str:
    parts = ["mokv", *path.relative_to(PACKAGE).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(source: str, name: str, is_package: bool = False) -> set[str]:
    """Every mokv module the source of module `name` imports, relative imports resolved."""
    package = (name if is_package else name.rpartition(".")[0]).split(".")
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            found.add(target)
            if node.module is None:  # `from . import x`: x may be a module
                found.update(f"{target}.{alias.name}" for alias in node.names)
    return {m for m in found if m == "mokv" or m.startswith("mokv.")}


def upward_imports(source: str, name: str, is_package: bool = False) -> list[str]:
    """The modules a module's source imports from layers above its own."""
    return sorted(m for m in imported_modules(source, name, is_package) if layer(m) > layer(name))


SOURCES = sorted(p for p in PACKAGE.rglob("*.py") if "mojo" not in p.relative_to(PACKAGE).parts)


def test_the_layers_name_real_modules() -> None:
    modules = {module_name(p) for p in SOURCES}
    for names in LAYERS:
        for name in names:
            assert name in modules, f"{name} is in LAYERS but is no module of mokv"


@pytest.mark.parametrize("path", SOURCES, ids=module_name)
def test_imports_point_down(path: Path) -> None:
    name = module_name(path)
    upward = upward_imports(path.read_text(), name, path.name == "__init__.py")
    assert not upward, f"{name} (layer {layer(name)}) imports {upward}, which sit above it"


def test_a_wrong_way_import_is_seen() -> None:
    """The check on the imports the layers exist to forbid."""
    assert upward_imports("from ..paged.page_pool import PagePool", "mokv.tiers.host") == ["mokv.paged.page_pool"]
    assert upward_imports("from ..tiers import Tier", "mokv.prefix.index") == ["mokv.tiers"]
    assert upward_imports("from . import manager", "mokv.paged", is_package=True) == []
    assert upward_imports("from .manager import X", "mokv.paged.replica") == ["mokv.paged.manager"]
    assert upward_imports("import mokv.paged.replica", "mokv.paged.commit") == ["mokv.paged.replica"]
    assert upward_imports("from .replica import Replica", "mokv.paged.batch_resolution") == []
