"""mokv's Mojo packages are found through the installed `mokv` package, by name; an
explicit source folder still builds (`mokv bench kernels --against REV` relies on it)."""

from __future__ import annotations

from importlib.resources import files
from pathlib import Path

import pytest

from mokv.kernels import MOKV_KERNELS, kernel_package, kernel_source_dir, kernel_source_names, kernel_sources_root


def test_every_mojo_package_of_the_checkout_is_shipped_by_name():
    checkout_mojo = Path(__file__).resolve().parents[1] / "mojo"
    assert kernel_sources_root() == (files("mokv") / "mojo").resolve() == checkout_mojo
    assert kernel_source_names() == sorted(p.parent.name for p in checkout_mojo.glob("*/__init__.mojo"))
    assert MOKV_KERNELS in kernel_source_names()
    for name in kernel_source_names():
        assert kernel_source_dir(name) == checkout_mojo / name


def test_an_unknown_package_is_named_with_the_ones_that_exist():
    with pytest.raises(ValueError, match=r"no Mojo package named 'mokv_nope' \(it has: .*mokv_kernels"):
        kernel_source_dir("mokv_nope")


def test_a_path_passed_as_a_string_is_refused_not_looked_up():
    with pytest.raises(ValueError, match="got '/tmp/mokv_kernels'; pass a source folder as a Path"):
        kernel_package("/tmp/mokv_kernels")


def test_a_name_and_its_folder_build_the_same_package(kernels: Path):
    assert kernel_package(MOKV_KERNELS) == kernel_package(kernel_source_dir()) == kernels
    assert kernels.name == f"{MOKV_KERNELS}.mojoc" and kernels.is_file()


@pytest.mark.parametrize("shared", ["parallel.mojo", "pointers.mojo"])
def test_both_packages_carry_the_same_shared_module(shared: str):
    """The fork-join and the pointer aliases, which each package needs because it is
    precompiled on its own: a link in the checkout, a copy in a wheel, the same text
    either way."""
    root = kernel_sources_root()
    assert (root / "mokv_kernels" / shared).read_text() == (root / "mokv_weights" / shared).read_text()
