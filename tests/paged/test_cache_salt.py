"""Cache salt: requests share cached pages only with requests of the same salt,
on the device and host tiers, even when their page hashes collide."""

from __future__ import annotations

import numpy as np
import pytest

from mokv import PagedKVCacheManager, TextContext
from tests.support.small_cache import MakeManager


def admit(m: PagedKVCacheManager, request_id: str, tokens, salt: str | None) -> TextContext:
    c = TextContext(request_id, np.asarray(tokens, np.int64), cache_salt=salt)
    m.claim(request_id)
    m.alloc(c)
    return c


def run(m: PagedKVCacheManager, request_id: str, tokens, salt: str | None) -> TextContext:
    c = admit(m, request_id, tokens, salt)
    c.update(0)
    m.step([[c]])
    m.release(request_id)
    return c


PROMPT = range(13)  # three full pages of 4, then one token


@pytest.mark.parametrize(("pages", "host_pages"), [(16, 0), (6, 16)])
def test_tenants_with_the_same_prompt_share_nothing(make_manager: MakeManager, pages: int, host_pages: int) -> None:
    m = make_manager(total_num_pages=pages, total_num_host_pages=host_pages)
    run(m, "alice-1", PROMPT, "alice")
    if host_pages:  # push alice's pages to the host tier
        run(m, "filler", range(500, 524), None)
    bob = admit(m, "bob", PROMPT, "bob")
    assert bob.processed_length == 0 and bob.cached_prefix_length == 0
    m.release("bob")
    unsalted = admit(m, "anon", PROMPT, None)
    assert unsalted.processed_length == 0
    m.release("anon")
    alice = admit(m, "alice-2", PROMPT, "alice")
    assert alice.processed_length == 12
    m.release("alice-2")
    by_salt = m.get_cache_tokens_by_salt()
    assert by_salt.get("alice") == 12 and "bob" not in by_salt
    if host_pages:  # alice's pages came back from the host tier
        assert m.get_metrics_aggregated().h2d_blocks_copied > 0


def test_unsalted_requests_share_as_before(make_manager: MakeManager) -> None:
    m = make_manager()
    run(m, "a", PROMPT, None)
    assert admit(m, "b", PROMPT, None).processed_length == 12
    assert m.get_cache_tokens_by_salt() == {None: 12}


@pytest.mark.parametrize(("pages", "host_pages"), [(16, 0), (6, 16)])
def test_forced_hash_collisions_never_cross_salts(make_manager: MakeManager, pages: int, host_pages: int) -> None:
    m = make_manager(total_num_pages=pages, total_num_host_pages=host_pages, checks=False)
    # Every page of every request hashes to its index, whatever the salt or tokens.
    m._hasher.hash_pages = lambda tokens, parent=None: list(range(len(tokens) // 4))  # type: ignore[method-assign]
    run(m, "alice", PROMPT, "alice")
    if host_pages:  # alice's pages go to the host tier, under the same colliding hashes
        run(m, "filler", range(500, 524), "filler")
    assert run(m, "bob", PROMPT, "bob").cached_prefix_length == 0
    # A collision costs hits, never correctness: bob's own pages now hold the hashes.
    assert admit(m, "bob-2", PROMPT, "bob").processed_length == 12


def test_a_first_page_completed_while_decoding_keeps_its_salt(make_manager: MakeManager) -> None:
    """A prompt shorter than a page: its first page fills up during decode,
    and is committed under its salt's root, not the unsalted one."""
    m = make_manager()
    alice = admit(m, "alice-1", [1, 2, 3], "alice")
    for token in (4, 5):  # the second update completes page [1, 2, 3, 4]
        m.runtime_inputs([[alice]])
        alice.update(token)
        m.step([[alice]])
        m.alloc(alice)
    m.release("alice-1")
    assert admit(m, "anon", [1, 2, 3, 4, 5], None).processed_length == 0
    assert admit(m, "bob", [1, 2, 3, 4, 5], "bob").processed_length == 0
    assert admit(m, "alice-2", [1, 2, 3, 4, 5], "alice").processed_length == 4
