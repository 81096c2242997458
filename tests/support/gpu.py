"""Whether MAX sees a GPU, and the mark that skips a GPU test module without one,
saying what it would run."""

from __future__ import annotations

import pytest
from max.driver import accelerator_count

HAS_GPU = accelerator_count() > 0


def needs_gpu(what: str) -> pytest.MarkDecorator:
    """Skips the module's tests without a GPU, saying what they would run."""
    return pytest.mark.skipif(not HAS_GPU, reason=f"no GPU on this machine: would run {what} on one")
