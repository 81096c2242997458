"""Fixtures for the paged manager tests: small caches that build in milliseconds."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

from mokv import PagedKVCacheManager, TextContext
from tests.paged.small_cache import small_paged_manager

MakeManager = Callable[..., PagedKVCacheManager]


@pytest.fixture
def make_manager() -> MakeManager:
    """Builds small caches (see `small_paged_manager`)."""
    return small_paged_manager


def ctx(request_id: str, tokens: list[int] | np.ndarray) -> TextContext:
    """A context with `tokens` as its prompt."""
    return TextContext(request_id, np.asarray(tokens, dtype=np.int64))
