"""mokv's Mojo packages as of another git revision of the checkout, for the benchmarks that
time this checkout's kernels beside a revision's (`mokv bench kernels`, `mokv bench weights
--against`): the sources are written from git's copy and precompiled like the checkout's."""

from __future__ import annotations

import posixpath
import subprocess
from pathlib import Path

import click

from mokv.kernels import MOKV_KERNELS, kernel_source_dir

GIT_LINK_MODE = "120000"
"""The mode `git ls-tree` gives a symbolic link."""


def _git(repo: Path, *args: str) -> bytes:
    result = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, check=False)
    if result.returncode != 0:
        raise click.ClickException(f"git {' '.join(args)}: {result.stderr.decode().strip()}")
    return result.stdout


def kernels_checkout(package: str = MOKV_KERNELS) -> tuple[Path, str]:
    """The git checkout the Mojo package `package` in use comes from, and its folder's path in it.

    Only a checkout (mokv installed editable, as `make setup` does) has revisions to
    compare; an installed wheel's kernels are not in one.
    """
    source = kernel_source_dir(package)
    try:
        repo = Path(_git(source, "rev-parse", "--show-toplevel").decode().strip())
    except click.ClickException as error:
        raise click.ClickException(
            f"comparing git revisions of mokv's kernels needs a mokv checkout, but the kernels in use ({source}) "
            f"are not in one; install mokv editable from a checkout (make setup). {error.message}"
        ) from error
    return repo, source.relative_to(repo).as_posix()


def kernel_sources_at(revision: str, dest: Path, package: str = MOKV_KERNELS) -> Path:
    """Writes the sources of the Mojo package `package` as of git `revision` under `dest`
    and returns their folder (named like the package, as precompiling requires).

    A file the package links to in another package (`parallel.mojo`) is written as the file
    it points to at `revision`: git keeps a link as its target's path."""
    repo, folder = kernels_checkout(package)
    entries = _git(repo, "ls-tree", "-r", revision, "--", folder).decode().splitlines()
    if not entries:
        raise click.ClickException(f"{revision} has no kernel sources at {folder} in {repo}")
    for entry in entries:
        mode, _, rest = entry.partition(" ")
        name = rest.split("\t", 1)[1]
        content = _git(repo, "show", f"{revision}:{name}")
        if mode == GIT_LINK_MODE:
            target = posixpath.normpath(posixpath.join(posixpath.dirname(name), content.decode()))
            content = _git(repo, "show", f"{revision}:{target}")
        path = dest / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content)
    return dest / folder
