"""Every shell script of the repository parses: most of them run only on a GPU machine lent
for fifteen minutes (`tools/gpu_proof.sh`) or in CI, where a quoting slip would cost the
whole run rather than fail here."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = sorted([*REPO.glob("tools/*.sh"), REPO / ".ci" / "run"])


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: str(p.relative_to(REPO)))
def test_script_parses(script: Path):
    result = subprocess.run(["bash", "-n", script], capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stderr
