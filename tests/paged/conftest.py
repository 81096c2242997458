"""Fixtures for the paged manager tests: small caches that build in milliseconds."""

from __future__ import annotations

import pytest

from tests.support.small_cache import MakeManager, small_paged_manager


@pytest.fixture
def make_manager() -> MakeManager:
    """Builds small caches (see `small_paged_manager`)."""
    return small_paged_manager
