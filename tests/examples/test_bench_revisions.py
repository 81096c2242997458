"""The kernel sources of a git revision, as the benchmarks that compare revisions write them
(`mokv_examples.bench.revisions`)."""

from __future__ import annotations

import subprocess
from pathlib import Path

from mokv.kernels import kernel_source_dir
from mokv_examples.bench.revisions import kernel_sources_at, kernels_checkout


def test_sources_at_a_revision_are_git_s_files(tmp_path: Path):
    """Each file as `git archive` extracts it, read through the links between packages."""
    folder = kernel_sources_at("HEAD", tmp_path / "written")
    assert folder.name == kernel_source_dir().name
    repo, kernels = kernels_checkout()
    tracked = subprocess.run(
        ["git", "-C", str(repo), "ls-files", "--", kernels],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    written = sorted(p.relative_to(tmp_path / "written").as_posix() for p in folder.rglob("*") if p.is_file())
    assert written == sorted(tracked)
    archive = subprocess.run(["git", "-C", str(repo), "archive", "HEAD", "mojo"], capture_output=True, check=True)
    (tmp_path / "archive").mkdir()
    subprocess.run(["tar", "-x", "-C", str(tmp_path / "archive")], input=archive.stdout, check=True)
    assert any((tmp_path / "archive" / name).is_symlink() for name in written), "no linked file left to check"
    for name in written:
        assert (tmp_path / "written" / name).read_bytes() == (tmp_path / "archive" / name).read_bytes(), name
