"""PagedKVCacheManager behaviour with hand-computed expectations.

Defaults (see conftest): page size 4, 16 pages, prefix caching on, runtime
invariant checks on, so every call below also re-checks the pool invariants.
"""

from __future__ import annotations

import numpy as np
import pytest
from max.dtype import DType
from max.graph import DeviceRef

from mokv import InsufficientBlocksError, KVCacheParams, KVCacheQuantConfig, PagedKVCacheManager, TextContext
from tests.support.small_cache import MakeManager, ctx


def run_request(m: PagedKVCacheManager, c: TextContext, decode: int = 1, replica: int = 0) -> None:
    """claim, alloc, then `decode` model steps (update, step, alloc), then release."""
    m.claim(c.request_id, replica)
    m.alloc(c, replica)
    batches = [[] for _ in range(m.num_replicas)]
    batches[replica] = [c]
    for i in range(decode):
        m.runtime_inputs(batches)
        c.update(1000 + i)
        m.step(batches)
        m.alloc(c, replica)
    m.release(c.request_id, replica)


def lookup(m: PagedKVCacheManager, batch: list[TextContext], **kw) -> tuple[np.ndarray, ...]:
    (inputs,) = m.runtime_inputs([batch], **kw).inputs
    return tuple(b.to_numpy() for b in inputs.flatten()[1:])


def test_first_request_gets_the_first_blocks(make_manager: MakeManager) -> None:
    m = make_manager()
    c = ctx("a", range(10))
    m.claim("a")
    m.alloc(c)
    assert m.get_req_blocks("a") == [0, 1, 2]
    assert m.num_free_blocks() == 13 and m.get_num_used_pages() == 3
    assert c.processed_length == 0 and c.active_length == 10


def test_blocks_are_reused_after_release(make_manager: MakeManager) -> None:
    m = make_manager()
    run_request(m, ctx("a", range(10)))  # commits blocks 0, 1 (tokens 0..7)
    b = ctx("b", range(10))
    m.claim("b")
    m.alloc(b)
    # Blocks came back tail first: the queue is 3..15, then 2, 1, 0.
    assert m.get_req_blocks("b") == [0, 1, 3]
    assert (b.processed_length, b.active_length) == (8, 2)
    metrics = m.get_metrics_aggregated()
    # a: 10 prompt + 1 decode token computed; b: 2 computed, 8 from cache.
    assert (metrics.input_tokens, metrics.cache_tokens) == (13, 8)
    assert metrics.cache_hit_rate == pytest.approx(8 / 21)


def test_the_last_token_is_never_served_from_cache(make_manager: MakeManager) -> None:
    m = make_manager()
    run_request(m, ctx("a", range(8)))  # 8 prompt tokens, both blocks committed after a step
    b = ctx("b", range(8))
    m.claim("b")
    m.alloc(b)
    # Only block 0 is hashable for b: its block 1 ends with b's last token.
    assert b.processed_length == 4 and b.active_length == 4
    assert m.get_req_blocks("b")[0] == 0


def test_decode_grows_one_block_per_page(make_manager: MakeManager) -> None:
    m = make_manager(page_size=4, prefix_caching=False)
    c = ctx("a", [1, 2, 3])
    m.claim("a")
    m.alloc(c)
    counts = []
    for t in range(14):
        c.update(t)
        m.alloc(c)
        counts.append(len(m.get_req_blocks("a")))
    # 4..17 tokens: a new block exactly when the length passes a multiple of 4.
    assert counts == [-(-n // 4) for n in range(4, 18)]
    assert m.get_req_blocks("a") == [0, 1, 2, 3, 4]


def test_exact_eviction_order(make_manager: MakeManager) -> None:
    m = make_manager(total_num_pages=6)
    run_request(m, ctx("a", range(9)))  # a: blocks 0,1,2; commits 0 and 1
    # Free queue: 3, 4, 5, then a's blocks tail first: 2, 1, 0.
    c = ctx("c", np.arange(100, 116))
    m.claim("c")
    m.alloc(c)
    assert m.get_req_blocks("c") == [3, 4, 5, 2]
    d = ctx("d", [200])
    m.claim("d")
    m.alloc(d)
    assert m.get_req_blocks("d") == [1]  # a's tail is evicted before its head
    m.release("c")  # queue: 0, then c's blocks tail first: 2, 5, 4, 3
    e = ctx("e", range(9))
    m.claim("e")
    m.alloc(e)
    assert m.get_req_blocks("e") == [0, 2, 5] and e.processed_length == 4
    assert m.get_metrics_aggregated().cache_tokens == 4


def test_a_hit_moves_the_block_to_the_back_of_the_queue(make_manager: MakeManager) -> None:
    m = make_manager(total_num_pages=4)
    run_request(m, ctx("a", range(5)))  # a: blocks 0, 1; commits 0
    run_request(m, ctx("b", range(5)))  # b hits block 0, takes block 2
    # Queue was 2, 3, 1, 0; b took 0 and 2 and gave back 2 then 0.
    c = ctx("c", np.arange(50, 58))
    m.claim("c")
    m.alloc(c)
    assert m.get_req_blocks("c") == [3, 1]


def test_step_dedups_identical_blocks(make_manager: MakeManager) -> None:
    m = make_manager()
    a, b = ctx("a", range(10)), ctx("b", range(10))
    for c in (a, b):
        m.claim(c.request_id)
        m.alloc(c)
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
    for c in contexts:
        m.claim(c.request_id)
        m.alloc(c)
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
    """Each request's pages, the free queue and the prefix index (each slot's
    tokens and parent slot: uids depend on the order blocks were committed in)."""
    index = m._replicas[0].pool.index
    slot_of_uid = {index.uid[slot]: slot for slot in index.committed_slots()}
    committed = {
        block_hash: (slot, slot_of_uid.get(index.parent_uid[slot]), index.tokens[slot].tolist())
        for block_hash, slot in index._by_hash.items()
    }
    pages = {c.request_id: m.get_req_blocks(c.request_id) for c in contexts}
    return pages, m._replicas[0].pool.free_order(), committed


def test_a_mixed_batch_commits_as_its_requests_one_at_a_time(make_manager: MakeManager) -> None:
    """One step over a batch where some requests share blocks (deduplicated in
    batch order) and others are unique (committed together) ends where
    stepping each request alone ends: the same pages, free queue and prefix
    index (uids aside: only their parent links are compared)."""
    prompts = {
        "a": range(10),
        "b": range(10),  # a's twin
        "c": range(100, 110),  # unique
        "d": [*range(4), *range(50, 56)],  # a's first block, then its own
        "e": range(200, 209),  # unique
        "f": [*range(4), *range(50, 54), 60, 61],  # d's two blocks: d, before it, keeps its own
        "g": [*range(4), *range(70, 76)],  # a's first block, then its own (committed with h's)
        "h": [*range(4), *range(80, 86)],
    }

    batched = prefilled(make_manager(total_num_pages=32), prompts, batched=True)
    assert batched == prefilled(make_manager(total_num_pages=32), prompts, batched=False)
    pages = batched[0]
    assert pages["b"][:2] == pages["a"][:2] and pages["d"][0] == pages["a"][0] and pages["f"][:2] == pages["d"][:2]
    assert pages["g"][0] == pages["h"][0] == pages["a"][0]
    assert len(batched[2]) == 2 + 2 + 1 + 2 + 1 + 1  # a's blocks, c's, d's second, e's, g's second, h's


def test_a_leader_whose_own_blocks_collide_commits_at_its_turn(make_manager: MakeManager) -> None:
    """A batch whose first run repeats a hash within itself (a collision: the
    fake hash is the block's token sum) cannot commit its leaders in one call;
    every request still ends where stepping each alone ends."""
    prompts = {
        "j": [1, 2, 3, 4, 4, 3, 2, 1, 9, 9],  # two blocks, both "hash" 10
        "u": [50, 0, 0, 0, 0, 0, 0, 60, 8, 8],  # a leader of its own
        "k": [50, 0, 0, 0, 0, 0, 0, 60, 5, 5],  # u's twin blocks
        "v": [70, 0, 0, 0, 80, 0, 0, 0, 6, 6],  # a rest nobody shares
    }

    def manager() -> PagedKVCacheManager:
        m = make_manager(checks=False)
        m._hasher.hash_blocks = lambda tokens, parent=None: [  # type: ignore[method-assign]
            int(block.sum()) for block in np.asarray(tokens).reshape(-1, 4)
        ]
        return m

    batched = prefilled(manager(), prompts, batched=True)
    assert batched == prefilled(manager(), prompts, batched=False)
    pages, _, committed = batched
    assert pages["k"][:2] == pages["u"][:2]
    assert len(committed) == 1 + 2 + 2  # j's first block (its second collides with it), u's, v's


def test_decode_commits_match_stepping_each_request_alone(make_manager: MakeManager) -> None:
    """Decode steps that fill one block per request (committed for the batch
    at once) end where stepping each request alone ends: once with twins
    among the new blocks (a and b generate the same tokens at first, so b's
    block is swapped for a's), once without (they diverge)."""
    prompts = {"a": range(6), "b": range(6), "c": range(20, 30), "d": range(40, 50)}

    def run(batched: bool) -> tuple:
        m = make_manager(total_num_pages=32)
        contexts = admitted(m, prompts)
        # Every request fills a block on updates 2 and 6 (a, b: blocks 1, 2; c, d: 2, 3).
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
    assert len(committed) == 3 + 1 + 4 + 4  # a's three blocks, b's third, c's, d's


def test_hit_rate_on_repeated_prompts(make_manager: MakeManager) -> None:
    m = make_manager(page_size=4, total_num_pages=32)
    prompt = np.arange(21)
    for i in range(5):
        run_request(m, ctx(f"r{i}", prompt), decode=0 if i else 1)
    # r0 computes 21 + 1 tokens and commits 5 blocks; r1..r4 each reuse the
    # 5 blocks before the last token and compute 1.
    metrics = m.get_metrics_aggregated()
    assert (metrics.input_tokens, metrics.cache_tokens) == (22 + 4, 4 * 20)
    assert metrics.cache_hit_rate == pytest.approx(80 / 106)
    m.reset_metrics()
    assert m.get_metrics_aggregated().cache_hit_rate == 0.0


def test_out_of_blocks_error_names_the_numbers(make_manager: MakeManager) -> None:
    m = make_manager(total_num_pages=4)
    m.claim("long")
    with pytest.raises(
        InsufficientBlocksError,
        match=r"needs 17 tokens of KV \(current_length 17, num_steps=1\) but a replica holds only 16 \(4 pages of 4",
    ):
        m.alloc(ctx("long", range(17)))
    m.claim("a")
    m.alloc(ctx("a", range(12)))
    b = ctx("b", range(100, 108))
    m.claim("b")
    with pytest.raises(
        InsufficientBlocksError,
        match=r"'b' needs 2 new blocks on replica 0 but only 1 are free \(3/4 in use\)",
    ):
        m.alloc(b)
    assert m.get_req_blocks("b") == [] and m.num_free_blocks() == 1
    assert m.get_metrics_aggregated().input_tokens == 12


def test_failed_alloc_keeps_the_request_and_metrics(make_manager: MakeManager) -> None:
    m = make_manager(total_num_pages=6)
    run_request(m, ctx("a", range(9)))  # caches blocks 0, 1; queue: 3, 4, 5, 2, 1, 0
    m.claim("x")
    m.alloc(ctx("x", np.arange(50, 58)))  # takes 3 and 4
    b = ctx("b", range(20))  # would hit 0 and 1, then need 3 more of the 2 left over
    m.claim("b")
    before = m.get_metrics_aggregated()
    with pytest.raises(InsufficientBlocksError, match=r"needs 3 new blocks .* only 2 are free \(2/6 in use\)"):
        m.alloc(b)
    assert b.processed_length == 0 and m.get_req_blocks("b") == []
    assert m.num_free_blocks() == 4 and m.get_metrics_aggregated() == before
    m.release("x")
    m.alloc(b)  # the cached blocks are still there
    assert m.get_req_blocks("b")[:2] == [0, 1] and b.processed_length == 8


def test_failed_alloc_refreshes_its_prefix_hits(make_manager: MakeManager) -> None:
    """MAX's manager touches the cached blocks a failed allocation matched, so
    they move to the most-recently-used end of the free queue (tail first)
    and outlive the blocks behind them; the retry then finds the whole prefix."""
    m = make_manager(page_size=1, total_num_pages=10)
    g = ctx("g", [30, 31])
    m.claim("g")
    m.alloc(g)  # blocks 0, 1
    a = ctx("a", [1, 2, 3, 4])
    m.claim("a")
    m.alloc(a)  # blocks 2..5
    a.update(5)
    m.step([[a]])  # commits 2..5
    m.release("a")
    m.release("g")  # queue: 6, 7, 8, 9, 5, 4, 3, 2, 1, 0
    m.claim("h")
    m.alloc(ctx("h", [20, 21, 22, 23]))  # 6..9
    c = ctx("c", [1, 2, 3, 4, 40, 41, 42])
    m.claim("c")
    with pytest.raises(InsufficientBlocksError, match="needs 3 new blocks"):
        m.alloc(c)  # hits 2..5, needs 3 more of the 2 left
    assert c.processed_length == 0 and m.get_req_blocks("c") == []
    assert m._replicas[0].pool.free_order() == [1, 0, 5, 4, 3, 2]
    m.claim("d")
    m.alloc(ctx("d", [60, 61]))
    assert m.get_req_blocks("d") == [1, 0]  # not the cached prefix's 5 and 4
    m.release("h")
    m.alloc(c)
    assert c.processed_length == 4 and m.get_req_blocks("c")[:4] == [2, 3, 4, 5]


@pytest.mark.parametrize("page_size", [1, 3, 16, 128])
@pytest.mark.parametrize("prefix_caching", [True, False])
def test_no_leak_after_a_random_workload(make_manager: MakeManager, page_size: int, prefix_caching: bool) -> None:
    rng = np.random.default_rng(page_size)
    total = 4096 // page_size + 8
    m = make_manager(page_size, total, prefix_caching=prefix_caching, max_batch_size=64)
    prefixes = [rng.integers(0, 5, size=rng.integers(1, 300)) for _ in range(3)]
    live: dict[str, TextContext] = {}
    for i in range(200):
        if live and (rng.random() < 0.3 or len(live) >= 12):
            rid = list(live)[rng.integers(len(live))]
            m.release(rid)
            del live[rid]
            continue
        if live and rng.random() < 0.5:
            batch = list(live.values())
            m.runtime_inputs([batch])
            for c in batch:
                c.update(int(rng.integers(0, 5)))
            m.step([batch])
            for c in batch:
                try:
                    m.alloc(c)
                except InsufficientBlocksError:
                    m.release(c.request_id)
                    del live[c.request_id]
            continue
        prompt = np.concatenate([prefixes[rng.integers(3)], rng.integers(0, 5, size=rng.integers(1, 40))])
        c = ctx(f"r{i}", prompt)
        m.claim(c.request_id)
        try:
            m.alloc(c)
            live[c.request_id] = c
        except InsufficientBlocksError:
            m.release(c.request_id)
    for rid in live:
        m.release(rid)
    assert m.num_free_blocks() == total and m.get_num_used_pages() == 0
    if prefix_caching:
        assert m.get_metrics_aggregated().cache_tokens > 0


def test_runtime_inputs_contents(make_manager: MakeManager) -> None:
    m = make_manager()
    a, b = ctx("a", range(10)), ctx("b", range(100, 103))
    for c in (a, b):
        m.claim(c.request_id)
        m.alloc(c)
    (inputs,) = m.runtime_inputs([[a, b]]).inputs
    assert list(inputs.blocks.shape) == [17, 2, 1, 4, 1, 2] and inputs.blocks is m.get_device_buffer(0).values[0]
    cache_lengths, table, max_lengths = lookup(m, [a, b])
    assert cache_lengths.tolist() == [0, 0]
    assert table.tolist() == [[0, 1, 2], [3, 16, 16]]  # 16 = the null page
    assert max_lengths.tolist() == [[10, 10]]
    for c in (a, b):
        c.update(7)
    m.step([[a, b]])
    for c in (a, b):
        m.alloc(c)
    cache_lengths, table, max_lengths = lookup(m, [b, a], max_cache_length=20)
    assert cache_lengths.tolist() == [3, 10]
    assert table.tolist() == [[3, 16, 16, 16, 16], [0, 1, 2, 16, 16]]
    assert max_lengths.tolist() == [[1, 11]]
    assert [x.dtype for x in (cache_lengths, table, max_lengths)] == [np.uint32] * 3
    leaf = m.runtime_inputs([[a]])
    (inputs,) = leaf.inputs
    assert list(inputs) == inputs.flatten() == leaf.flatten()


def test_runtime_inputs_rejects_bad_batches(make_manager: MakeManager) -> None:
    m = make_manager(max_batch_size=2)
    cs = [ctx(f"r{i}", range(5)) for i in range(3)]
    for c in cs:
        m.claim(c.request_id)
    with pytest.raises(ValueError, match="'r0' holds 0 pages but needs 2 for 5 tokens: call alloc first"):
        m.runtime_inputs([cs[:1]])
    for c in cs:
        m.alloc(c)
    with pytest.raises(ValueError, match="batch has 3 requests, max_batch_size is 2"):
        m.runtime_inputs([cs])
    with pytest.raises(ValueError, match="expected one batch per replica \\(1\\), got 2"):
        m.runtime_inputs([cs[:1], []])
    with pytest.raises(ValueError, match="max_cache_length=4 gives 1 pages, but the batch needs 2"):
        m.runtime_inputs([cs[:1]], max_cache_length=4)
    with pytest.raises(ValueError, match="'ghost' is not claimed"):
        m.runtime_inputs([[ctx("ghost", [1])]])
    (empty,) = m.runtime_inputs([[]]).inputs
    assert empty.lookup_table.shape == (0, 0) and empty.max_lengths.to_numpy().tolist() == [[0, 0]]


def test_multi_step_max_lengths_rows(make_manager: MakeManager) -> None:
    m = make_manager()
    a, b = ctx("a", range(6)), ctx("b", range(100, 103))
    for c in (a, b):
        m.claim(c.request_id)
        m.alloc(c)
    with pytest.raises(ValueError, match="'b' holds 1 pages but needs 2 for 5 tokens"):
        m.runtime_inputs([[a, b]], num_steps=3)
    for c in (a, b):
        m.alloc(c, num_steps=3)
    assert len(m.get_req_blocks("a")) == 2 and len(m.get_req_blocks("b")) == 2  # 8 and 5 tokens
    cache_lengths, table, max_lengths = lookup(m, [a, b], num_steps=3)
    assert max_lengths.tolist() == [[6, 6], [1, 7], [1, 8]]
    assert table.shape == (2, 2) and cache_lengths.tolist() == [0, 0]
    # A single-step batch does not see the pages reserved for the later steps.
    _, table, max_lengths = lookup(m, [a, b])
    assert table.tolist() == [[0, 1], [2, 16]] and max_lengths.tolist() == [[6, 6]]


def test_batch_characteristics_fix_max_lengths(make_manager: MakeManager) -> None:
    from mokv import BatchCharacteristics

    m = make_manager()
    a = ctx("a", range(6))
    m.claim("a")
    m.alloc(a)
    _, _, max_lengths = lookup(m, [a], batch_characteristics=BatchCharacteristics(4, 8, 32))
    assert max_lengths.tolist() == [[8, 32]]
    with pytest.raises(ValueError, match="exceeds"):
        m.runtime_inputs([[a]], batch_characteristics=BatchCharacteristics(4, 5, 32))


def test_reserve_releases_on_exit_and_on_error(make_manager: MakeManager) -> None:
    m = make_manager()
    a, b = ctx("a", range(9)), ctx("b", range(5))
    with m.reserve([[a, b]]):
        assert m.contains("a") and m.contains("b")
        assert m.get_req_blocks("a") == [0, 1, 2] and m.get_req_blocks("b") == [3, 4]
        m.runtime_inputs([[a, b]])
    assert not m.contains("a") and not m.contains("b") and m.num_free_blocks() == 16
    with pytest.raises(InsufficientBlocksError), m.reserve([[ctx("c", range(40)), ctx("d", range(40))]]):
        pass  # pragma: no cover - d does not fit
    assert not m.contains("c") and not m.contains("d") and m.num_free_blocks() == 16


def test_alloc_dummy_points_at_the_null_page(make_manager: MakeManager) -> None:
    m = make_manager()
    m.alloc_dummy("pad")
    assert m.contains("pad") and m.get_req_blocks("pad") == [16]
    assert m.num_free_blocks() == 16
    cache_lengths, table, _ = lookup(m, [ctx("pad", [0])])
    assert table.tolist() == [[16]] and cache_lengths.tolist() == [0]
    with pytest.raises(ValueError, match="'pad' is a dummy"):
        m.alloc(ctx("pad", [0]))
    m.step([[ctx("pad", [0, 1])]])
    m.release("pad")
    assert not m.contains("pad") and m.num_free_blocks() == 16


def test_claims_are_checked(make_manager: MakeManager) -> None:
    m = make_manager(data_parallel_degree=2)
    m.claim("a", 1)
    with pytest.raises(ValueError, match="'a' is already claimed on replica 1"):
        m.claim("a", 0)
    with pytest.raises(ValueError, match="'a' is claimed on replica 1, not on replica 0"):
        m.alloc(ctx("a", [1]), 0)
    with pytest.raises(ValueError, match="'b' is not claimed, not on replica 0"):
        m.release("b", 0)
    with pytest.raises(ValueError, match="replica_idx=2 is out of range: there are 2 replicas"):
        m.claim("c", 2)
    assert m.contains("a", 1) and not m.contains("a", 0)


def test_replicas_have_separate_pools(make_manager: MakeManager) -> None:
    m = make_manager(data_parallel_degree=2)
    a0, a1, b1 = ctx("a0", range(200, 209)), ctx("a1", range(9)), ctx("b1", range(5))
    m.claim("a0", 0)
    m.claim("a1", 1)
    m.claim("b1", 1)
    m.alloc(a0, 0)
    m.alloc(a1, 1)
    m.alloc(b1, 1)
    assert m.get_req_blocks("a0", 0) == [0, 1, 2]
    assert m.get_req_blocks("a1", 1) == [0, 1, 2] and m.get_req_blocks("b1", 1) == [3, 4]
    assert (m.num_free_blocks(0), m.num_free_blocks(1)) == (13, 11)
    r0, r1 = m.runtime_inputs([[a0], [a1, b1]]).inputs
    assert r0.blocks is m.get_device_buffer(0).values[0] and r1.blocks is m.get_device_buffer(1).values[0]
    assert r0.blocks is not r1.blocks
    assert r0.lookup_table.shape == (1, 3) and r1.lookup_table.shape == (2, 3)
    for c in (a0, a1, b1):
        c.update(5)
    m.step([[a0], [a1, b1]])
    m.release("a1", 1)
    assert m.get_req_blocks("b1", 1) == [0, 4]  # b1's first block deduped into a1's
    # a1's prefix is cached on replica 1 only.
    c0, c1 = ctx("c0", range(9)), ctx("c1", range(9))
    m.claim("c0", 0)
    m.alloc(c0, 0)
    m.claim("c1", 1)
    m.alloc(c1, 1)
    assert c0.processed_length == 0 and c1.processed_length == 8
    assert m.get_metrics_aggregated().cache_tokens == 8


def test_reset_prefix_cache_drops_only_unheld_blocks(make_manager: MakeManager) -> None:
    m = make_manager()
    a = ctx("a", range(9))
    m.claim("a")
    m.alloc(a)
    a.update(1)
    m.step([[a]])  # a holds committed blocks 0, 1
    run_request(m, ctx("q", range(50, 59)))  # caches q's blocks, then frees them
    m.reset_prefix_cache()
    q2 = ctx("q2", range(50, 59))
    m.claim("q2")
    m.alloc(q2)
    assert q2.processed_length == 0
    p = ctx("p", range(9))
    m.claim("p")
    m.alloc(p)
    assert p.processed_length == 8 and m.get_req_blocks("p")[:2] == [0, 1]


def test_a_hash_collision_never_shares_kv(make_manager: MakeManager) -> None:
    m = make_manager(checks=False)
    m._hasher.hash_blocks = lambda tokens, parent=None: list(range(len(tokens) // 4))  # type: ignore[method-assign]
    run_request(m, ctx("a", range(9)))  # commits "hashes" 0 and 1 to blocks 0 and 1
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


def test_a_collision_with_a_held_block_ends_the_chain(make_manager: MakeManager) -> None:
    """A new block whose hash names another request's held block with other
    tokens can neither share nor replace it: the request's chain stops there,
    and none of its later blocks is offered to the prefix cache."""
    m = make_manager(checks=False)
    m._hasher.hash_blocks = lambda tokens, parent=None: list(range(len(tokens) // 4))  # type: ignore[method-assign]
    a, b = ctx("a", range(9)), ctx("b", range(100, 109))
    for c in (a, b):
        m.claim(c.request_id)
        m.alloc(c)
    a.update(1)
    m.step([[a]])  # a commits fake hashes 0 and 1 and keeps its blocks
    b.update(1)
    m.step([[b]])  # b's hash 0 names a's held block 0, whose tokens differ
    index = m._replicas[0].pool.index
    assert sorted(index._by_hash.values()) == m.get_req_blocks("a")[:2]
    for token in range(2, 6):  # b fills a third block: nothing more is committed for it
        m.alloc(b)
        b.update(token)
        m.step([[b]])
    assert len(index) == 2
    assert m.num_free_blocks() == 16 - 3 - 4  # a holds 3 blocks, b 4: none was swapped or lost
    m.release("b")
    c = ctx("c", range(100, 109))  # b's prompt again: no hit
    m.claim("c")
    m.alloc(c)
    assert c.processed_length == 0


def test_a_collision_within_one_request_ends_its_chain(make_manager: MakeManager) -> None:
    """Two blocks of one request under one hash: the first is committed, the
    second (its tokens differ) cannot share or replace it, so the chain stops."""
    m = make_manager(checks=False)
    m._hasher.hash_blocks = lambda tokens, parent=None: [7] * (len(tokens) // 4)  # type: ignore[method-assign]
    a = ctx("a", range(13))
    m.claim("a")
    m.alloc(a)
    a.update(1)
    m.step([[a]])
    index = m._replicas[0].pool.index
    assert index._by_hash == {7: m.get_req_blocks("a")[0]}
    assert index.tokens[m.get_req_blocks("a")[0]].tolist() == [0, 1, 2, 3]
    for token in range(2, 6):  # a fourth block fills: the broken chain commits nothing more
        m.alloc(a)
        a.update(token)
        m.step([[a]])
    assert len(index) == 1 and m.num_free_blocks() == 16 - 5


def test_pct_used_blocks_after_allocation(make_manager: MakeManager) -> None:
    m = make_manager()
    a = ctx("a", range(9))
    assert m.get_pct_used_blocks_after_allocation(a) == 3 / 16
    m.claim("a")
    m.alloc(a)
    assert m.get_pct_used_blocks_after_allocation(ctx("b", range(20))) == (3 + 5) / 16
    assert m.get_pct_used_blocks_after_allocation(a) == 3 / 16
    assert m.get_pct_used_blocks_after_allocation(ctx("c", range(100))) == 1.0


def test_page_counts(make_manager: MakeManager) -> None:
    m = make_manager(total_num_pages=10)
    assert (m.get_num_pages(0), m.total_num_blocks(0), m.get_num_used_pages(0)) == (10, 10, 0)
    assert (m.get_num_host_pages(0), m.get_num_used_host_pages(0)) == (0, 0)
    assert (m.get_num_disk_pages(0), m.get_num_used_disk_pages(0)) == (0, 0)
    buffer = m.get_device_buffer(0)
    assert (buffer.total_num_pages, buffer.num_physical_pages) == (10, 11)
    assert not buffer.to_memory()[0].buffer.to_numpy().any()


def test_constructor_validation(make_manager: MakeManager) -> None:
    with pytest.raises(ValueError, match="total_num_pages must be >= 1, got 0"):
        make_manager(total_num_pages=0)
    with pytest.raises(ValueError, match="max_batch_size must be >= 1, got 0"):
        make_manager(max_batch_size=0)
    with pytest.raises(ValueError, match="total_num_host_pages=4 needs enable_prefix_caching=True"):
        make_manager(prefix_caching=False, total_num_host_pages=4)


def test_runtime_inputs_stay_intact_through_the_next_call(make_manager: MakeManager) -> None:
    """The contract's lifetime promise: a call's tables are intact until the
    manager's next runtime_inputs call has returned (the staging arrays are
    reused, double-buffered)."""
    m = make_manager()
    a, b = ctx("a", range(10)), ctx("b", range(100, 103))
    for c in (a, b):
        m.claim(c.request_id)
        m.alloc(c)
    (first,) = m.runtime_inputs([[a, b]]).inputs
    saved = [x.to_numpy().copy() for x in first.flatten()[1:]]
    a.update(7)
    m.alloc(a)
    (second,) = m.runtime_inputs([[a]], num_steps=1).inputs
    for kept, now in zip(saved, first.flatten()[1:], strict=True):
        np.testing.assert_array_equal(now.to_numpy(), kept)
    assert second.lookup_table.to_numpy().tolist() == [[0, 1, 2]]
    assert second.cache_lengths.to_numpy().tolist() == [10]
    (third,) = m.runtime_inputs([[b, a]]).inputs
    assert third.lookup_table.to_numpy().tolist() == [[3, 16, 16], [0, 1, 2]]
    assert second.lookup_table.to_numpy().tolist() == [[0, 1, 2]]


def test_runtime_inputs_reuse_their_objects_with_fresh_values(make_manager: MakeManager) -> None:
    """On host devices, a call with the same table shapes as the call before
    the last gives back the same input objects, refilled with its own values."""
    m = make_manager()
    a = ctx("a", range(5))
    m.claim(a.request_id)
    m.alloc(a)
    first = m.runtime_inputs([[a]])
    assert m.runtime_inputs([[a]]) is not first  # the other set of arrays
    a.update(9)
    m.alloc(a)
    third = m.runtime_inputs([[a]])
    assert third is first
    (device,) = third.inputs
    assert device.cache_lengths.to_numpy().tolist() == [5]
    assert device.lookup_table.to_numpy().tolist() == [m.get_req_blocks("a")]
    assert device.max_lengths.to_numpy().tolist() == [[1, 6]]


def test_a_quantized_cache_allocates_scales_beside_every_shards_blocks() -> None:
    """Two replicas of two TP shards: every shard gets its zeroed float32
    scales, paged like its int8 blocks (null page included), and the host
    tier's pages hold the scales too."""
    cpu = DeviceRef.CPU()
    params = KVCacheParams(
        DType.int8,
        n_kv_heads=4,
        head_dim=8,
        num_layers=2,
        page_size=4,
        enable_prefix_caching=True,
        data_parallel_degree=2,
        devices=[cpu] * 4,
        kvcache_quant_config=KVCacheQuantConfig(quantization_granularity=4, tokens_per_scale=2),
    )
    m = PagedKVCacheManager(params, None, 8, total_num_host_pages=3, max_batch_size=2)
    for replica in range(2):
        buffer = m.get_device_buffer(replica)
        assert [(list(v.shape), v.dtype) for v in buffer.values] == [([9, 2, 2, 4, 2, 8], DType.int8)] * 2
        assert buffer.scales is not None
        assert [(list(s.shape), s.dtype) for s in buffer.scales] == [([9, 2, 2, 2, 2, 2], DType.float32)] * 2
        assert all(s.device == v.device for s, v in zip(buffer.scales, buffer.values, strict=True))
        assert not any(s.to_numpy().any() for s in buffer.scales)
    # A host page holds one page of both shards: (4 tokens x K,V x 2 layers x 2 heads x 8 bytes)
    # plus (2 scale rows x K,V x 2 layers x 2 heads x 2 float32 scales), twice.
    host_page = 2 * (4 * 2 * 2 * 2 * 8 + 2 * 2 * 2 * 2 * 2 * 4)
    assert m.get_tier_usage(0)["host"].total_bytes == 3 * host_page
