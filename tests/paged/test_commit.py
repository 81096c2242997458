"""PagedKVCacheManager.step: committing newly full pages, deduplication, and
hash collisions. A batch commits as its requests would one at a time.

Defaults (see conftest): page size 4, 16 pages, prefix caching on, runtime
invariant checks on, so every call below also re-checks the pool invariants.
"""

from __future__ import annotations

import numpy as np

from mokv import PagedKVCacheManager, TextContext
from tests.support.small_cache import MakeManager, admit, ctx, run_request


def test_step_dedups_identical_pages(make_manager: MakeManager) -> None:
    m = make_manager()
    a, b = ctx("a", range(10)), ctx("b", range(10))
    admit(m, a, b)
    assert m.get_req_blocks("b") == [3, 4, 5]  # nothing was committed yet
    for c in (a, b):
        c.update(99)
    m.step([[a, b]])
    assert m.get_req_blocks("a") == [0, 1, 2]
    assert m.get_req_blocks("b") == [0, 1, 5]  # 3 and 4 replaced by a's twins
    assert m.num_free_blocks() == 16 - 4
    m.release("a")
    m.release("b")
    assert m.num_free_blocks() == 16


def admitted(m: PagedKVCacheManager, prompts: dict) -> list[TextContext]:
    """A request per prompt on `m`, claimed and allocated in order."""
    contexts = [ctx(request_id, tokens) for request_id, tokens in prompts.items()]
    admit(m, *contexts)
    return contexts


def step_all(m: PagedKVCacheManager, contexts: list[TextContext], batched: bool) -> None:
    """Steps the requests as one batch, or each alone in order."""
    for batch in [contexts] if batched else [[c] for c in contexts]:
        m.step([batch])


def prefilled(m: PagedKVCacheManager, prompts: dict, batched: bool) -> tuple:
    """`committed_state` after admitting `prompts`, running them once and
    stepping them as one batch or each alone."""
    contexts = admitted(m, prompts)
    for c in contexts:
        c.update(7)
    step_all(m, contexts, batched)
    return committed_state(m, contexts)


def committed_state(m: PagedKVCacheManager, contexts: list[TextContext]) -> tuple:
    """Each request's pages, the free queue and the prefix index (each page's
    tokens and parent page: uids depend on the order pages were committed in)."""
    index = m._replicas[0].pool.index
    page_of_uid = {index.uid[page]: page for page in index.committed_pages()}
    committed = {
        page_hash: (page, page_of_uid.get(index.parent_uid[page]), index.tokens[page].tolist())
        for page_hash, page in index._by_hash.items()
    }
    pages = {c.request_id: m.get_req_blocks(c.request_id) for c in contexts}
    return pages, m._replicas[0].pool.free_order(), committed


def test_a_mixed_batch_commits_as_its_requests_one_at_a_time(make_manager: MakeManager) -> None:
    """One step over a batch where some requests share pages (deduplicated in
    batch order) and others are unique (committed together) ends where
    stepping each request alone ends: the same pages, free queue and prefix
    index (uids aside: only their parent links are compared)."""
    prompts = {
        "a": range(10),
        "b": range(10),  # a's twin
        "c": range(100, 110),  # unique
        "d": [*range(4), *range(50, 56)],  # a's first page, then its own
        "e": range(200, 209),  # unique
        "f": [*range(4), *range(50, 54), 60, 61],  # d's two pages: d, before it, keeps its own
        "g": [*range(4), *range(70, 76)],  # a's first page, then its own (committed with h's)
        "h": [*range(4), *range(80, 86)],
    }

    batched = prefilled(make_manager(total_num_pages=32), prompts, batched=True)
    assert batched == prefilled(make_manager(total_num_pages=32), prompts, batched=False)
    pages = batched[0]
    assert pages["b"][:2] == pages["a"][:2] and pages["d"][0] == pages["a"][0] and pages["f"][:2] == pages["d"][:2]
    assert pages["g"][0] == pages["h"][0] == pages["a"][0]
    assert len(batched[2]) == 2 + 2 + 1 + 2 + 1 + 1  # a's pages, c's, d's second, e's, g's second, h's


def test_a_leader_whose_own_pages_collide_commits_at_its_turn(make_manager: MakeManager) -> None:
    """A batch whose first run repeats a hash within itself (a collision: the
    fake hash is the page's token sum) cannot commit its leaders in one call;
    every request still ends where stepping each alone ends."""
    prompts = {
        "j": [1, 2, 3, 4, 4, 3, 2, 1, 9, 9],  # two pages, both "hash" 10
        "u": [50, 0, 0, 0, 0, 0, 0, 60, 8, 8],  # a leader of its own
        "k": [50, 0, 0, 0, 0, 0, 0, 60, 5, 5],  # u's twin pages
        "v": [70, 0, 0, 0, 80, 0, 0, 0, 6, 6],  # a rest nobody shares
    }

    def manager() -> PagedKVCacheManager:
        m = make_manager(checks=False)
        m._hasher.hash_pages = lambda tokens, parent=None: [  # type: ignore[method-assign]
            int(page.sum()) for page in np.asarray(tokens).reshape(-1, 4)
        ]
        return m

    batched = prefilled(manager(), prompts, batched=True)
    assert batched == prefilled(manager(), prompts, batched=False)
    pages, _, committed = batched
    assert pages["k"][:2] == pages["u"][:2]
    assert len(committed) == 1 + 2 + 2  # j's first page (its second collides with it), u's, v's


def test_decode_commits_match_stepping_each_request_alone(make_manager: MakeManager) -> None:
    """Decode steps that fill one page per request (committed for the batch
    at once) end where stepping each request alone ends: once with twins
    among the new pages (a and b generate the same tokens at first, so b's
    page is swapped for a's), once without (they diverge)."""
    prompts = {"a": range(6), "b": range(6), "c": range(20, 30), "d": range(40, 50)}

    def run(batched: bool) -> tuple:
        m = make_manager(total_num_pages=32)
        contexts = admitted(m, prompts)
        # Every request fills a page on updates 2 and 6 (a, b: pages 1, 2; c, d: 2, 3).
        for k in range(7):
            for i, c in enumerate(contexts):
                m.alloc(c)
                c.update(100 * k + (0 if c.request_id in "ab" and k < 3 else i))
            step_all(m, contexts, batched)
        return committed_state(m, contexts)

    batched = run(batched=True)
    assert batched == run(batched=False)
    pages, _, committed = batched
    assert pages["b"][:2] == pages["a"][:2] and pages["b"][2] != pages["a"][2]
    assert len(committed) == 3 + 1 + 4 + 4  # a's three pages, b's third, c's, d's


def test_a_hash_collision_never_shares_kv(make_manager: MakeManager) -> None:
    m = make_manager(checks=False)
    m._hasher.hash_pages = lambda tokens, parent=None: list(range(len(tokens) // 4))  # type: ignore[method-assign]
    run_request(m, ctx("a", range(9)))  # commits "hashes" 0 and 1 to pages 0 and 1
    b = ctx("b", range(100, 109))  # same fake hashes, different tokens
    m.claim("b")
    m.alloc(b)
    assert b.processed_length == 0 and m.get_req_blocks("b") == [3, 4, 5]
    b.update(1)
    m.step([[b]])  # a's unheld entries cannot be verified, so b's replace them
    assert m.get_req_blocks("b") == [3, 4, 5]
    c = ctx("c", range(9))
    m.claim("c")
    m.alloc(c)
    assert c.processed_length == 0 and 3 not in m.get_req_blocks("c")


def test_a_collision_with_a_held_page_ends_the_chain(make_manager: MakeManager) -> None:
    """A new page whose hash names another request's held page with other
    tokens can neither share nor replace it: the request's chain stops there,
    and none of its later pages is offered to the prefix cache."""
    m = make_manager(checks=False)
    m._hasher.hash_pages = lambda tokens, parent=None: list(range(len(tokens) // 4))  # type: ignore[method-assign]
    a, b = ctx("a", range(9)), ctx("b", range(100, 109))
    admit(m, a, b)
    a.update(1)
    m.step([[a]])  # a commits fake hashes 0 and 1 and keeps its pages
    b.update(1)
    m.step([[b]])  # b's hash 0 names a's held page 0, whose tokens differ
    index = m._replicas[0].pool.index
    assert sorted(index._by_hash.values()) == m.get_req_blocks("a")[:2]
    for token in range(2, 6):  # b fills a third page: nothing more is committed for it
        m.alloc(b)
        b.update(token)
        m.step([[b]])
    assert len(index) == 2
    assert m.num_free_blocks() == 16 - 3 - 4  # a holds 3 pages, b 4: none was swapped or lost
    m.release("b")
    c = ctx("c", range(100, 109))  # b's prompt again: no hit
    m.claim("c")
    m.alloc(c)
    assert c.processed_length == 0


def test_a_collision_within_one_request_ends_its_chain(make_manager: MakeManager) -> None:
    """Two pages of one request under one hash: the first is committed, the
    second (its tokens differ) cannot share or replace it, so the chain stops."""
    m = make_manager(checks=False)
    m._hasher.hash_pages = lambda tokens, parent=None: [7] * (len(tokens) // 4)  # type: ignore[method-assign]
    a = ctx("a", range(13))
    m.claim("a")
    m.alloc(a)
    a.update(1)
    m.step([[a]])
    index = m._replicas[0].pool.index
    assert index._by_hash == {7: m.get_req_blocks("a")[0]}
    assert index.tokens[m.get_req_blocks("a")[0]].tolist() == [0, 1, 2, 3]
    for token in range(2, 6):  # a fourth page fills: the broken chain commits nothing more
        m.alloc(a)
        a.update(token)
        m.step([[a]])
    assert len(index) == 1 and m.num_free_blocks() == 16 - 5
