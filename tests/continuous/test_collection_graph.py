"""A graph built from the manager's input_symbols() and the opaque collection:
store, gather and attention over several steps, with increment_cache_lengths
advancing the lengths between steps, checked against the numpy cache and
attention models and against the same attention over a paged copy of the cache
(the paged strategy's op)."""

from __future__ import annotations

import numpy as np
import pytest
from max.driver import CPU, Buffer
from max.dtype import DType
from max.graph import DeviceRef, Graph, TensorType

from mokv import KVCacheParams, TextContext
from mokv.continuous import ContinuousBatchingKVCacheManager
from mokv.graph import FetchContinuousBatchingKVCacheCollection, attention, gather_kv, store_kv
from mokv_reference import cache as ref
from mokv_reference.attention import attention as reference_attention

HEAD_DIM = 16
PARAMS = KVCacheParams(dtype=DType.float32, n_kv_heads=3, head_dim=HEAD_DIM, num_layers=2)
MAX_SEQ_LEN = 32
LAYER = 1
N_Q_HEADS = 6  # grouped-query: two query heads per KV head
SCALE = 0.25
PAGE_SIZE = 8


@pytest.fixture(scope="module")
def collection_model(session, kernels):
    """Compiled once: (fetched cache, new K/V, row offsets, gather rows/positions,
    queries) -> gathered (K, V), attention, and (K, V) gathered again through the
    per-layer caches, after storing into layer LAYER through the opaque collection."""
    manager = ContinuousBatchingKVCacheManager(PARAMS, 4, MAX_SEQ_LEN, 2, [CPU()], session)
    cpu = DeviceRef.CPU()
    rows = TensorType(DType.float32, ["new_tokens", 3, HEAD_DIM], cpu)
    index = TensorType(DType.uint32, ["n"], cpu)
    offsets = TensorType(DType.uint32, ["batch_plus_one"], cpu)
    queries = TensorType(DType.float32, ["new_tokens", N_Q_HEADS, HEAD_DIM], cpu)
    inputs = [*manager.input_symbols()[0], rows, rows, offsets, index, index, queries]
    with Graph("continuous_collection", input_types=inputs, custom_extensions=[kernels]) as g:
        collection = FetchContinuousBatchingKVCacheCollection(PARAMS)(*g.inputs[:4])
        keys, values, row_offsets, batch_rows, positions, q = (v.tensor for v in g.inputs[4:])
        store_kv(collection, LAYER, keys, values, row_offsets)
        gathered = (gather_kv(collection, LAYER, kv, batch_rows, positions) for kv in (0, 1))
        # The same rows again through the per-layer opaque caches.
        per_layer = (collection.get_cache(LAYER, kv).gather(batch_rows, positions) for kv in (0, 1))
        g.output(*gathered, attention(collection, LAYER, q, row_offsets, SCALE), *per_layer)
    return session.load(g)


def _all_cached(lengths: dict[int, int], order: list[int]) -> tuple[np.ndarray, np.ndarray]:
    rows = np.concatenate([np.full(lengths[s], i) for i, s in enumerate(order)]).astype(np.uint32)
    positions = np.concatenate([np.arange(lengths[s]) for s in order]).astype(np.uint32)
    return rows, positions


def _paged_copy(blocks: np.ndarray, slots: list[int], lengths: list[int], rng) -> tuple[np.ndarray, np.ndarray]:
    """The same sequences laid out in shuffled pages of PAGE_SIZE tokens: a
    page tensor (with a trailing null page) and its lookup table."""
    pages_per_row = [-(-n // PAGE_SIZE) for n in lengths]
    num_pages = sum(pages_per_row)
    paged = np.zeros((num_pages + 1, *blocks.shape[1:3], PAGE_SIZE, *blocks.shape[4:]), blocks.dtype)
    lookup = np.full((len(slots), max(1, *pages_per_row)), num_pages, np.uint32)
    page_ids = iter(rng.permutation(num_pages))
    for row, (slot, n_pages) in enumerate(zip(slots, pages_per_row, strict=True)):
        for j in range(n_pages):
            page = next(page_ids)
            lookup[row, j] = page
            paged[page] = blocks[slot, :, :, j * PAGE_SIZE : (j + 1) * PAGE_SIZE]
    return paged, lookup


def _paged_attention(model, blocks, cache_lengths, lookup, q, offsets) -> np.ndarray:
    new = np.diff(offsets)
    max_lengths = np.array([[new.max(), (cache_lengths + new).max()]], np.uint32)
    (out,) = model.execute(
        Buffer.from_numpy(blocks),
        Buffer.from_numpy(cache_lengths),
        Buffer.from_numpy(lookup),
        Buffer.from_numpy(max_lengths),
        Buffer.from_numpy(q),
        Buffer.from_numpy(offsets),
        Buffer.from_numpy(np.array(LAYER, np.uint32)),
        Buffer.from_numpy(np.array(SCALE, np.float32)),
        Buffer.from_numpy(np.array(0, np.uint32)),
    )
    return out.to_numpy()


def test_multistep_store_and_attention_match_numpy_and_paged(collection_model, attention_graph, session):
    """A prefill step (with an idle row) then three decode steps whose inputs come
    from increment_cache_lengths, not from a fresh fetch."""
    rng = np.random.default_rng(0)
    paged_model = attention_graph("paged", DType.float32)
    manager = ContinuousBatchingKVCacheManager(PARAMS, 4, MAX_SEQ_LEN, 2, [CPU()], session)
    new_counts = np.array([5, 0, 3])  # a zero-new-token row in the prefill step
    contexts = [TextContext(f"r{i}", np.zeros(max(n, 1), np.int64)) for i, n in enumerate(new_counts)]
    seqs = [manager.claim(c.request_id) for c in contexts]
    order = [seqs[2], seqs[0], seqs[1]]
    contexts = [contexts[2], contexts[0], contexts[1]]
    new_counts = new_counts[[2, 0, 1]]
    slots = np.array(order, np.uint32)
    expected = manager.blocks[0].to_numpy().copy()
    lengths = dict.fromkeys(seqs, 0)
    inputs = manager.fetch(order)
    assert inputs[0][3].item() is True
    for _ in range(4):
        offsets = np.concatenate([[0], np.cumsum(new_counts)]).astype(np.uint32)
        keys = rng.standard_normal((int(offsets[-1]), 3, HEAD_DIM)).astype(np.float32)
        values = rng.standard_normal(keys.shape).astype(np.float32)
        q = rng.standard_normal((int(offsets[-1]), N_Q_HEADS, HEAD_DIM)).astype(np.float32)
        cache_lengths = np.array([lengths[s] for s in order], np.uint32)
        np.testing.assert_array_equal(inputs[0][1].to_numpy(), cache_lengths)
        ref.store(expected, LAYER, keys, values, offsets, cache_lengths, slots)
        for s, n in zip(order, new_counts, strict=True):
            lengths[s] += int(n)
        rows, positions = _all_cached(lengths, order)
        got_k, got_v, got_attention, layer_k, layer_v = collection_model.execute(
            *inputs[0],
            Buffer.from_numpy(keys),
            Buffer.from_numpy(values),
            Buffer.from_numpy(offsets),
            Buffer.from_numpy(rows),
            Buffer.from_numpy(positions),
            Buffer.from_numpy(q),
        )
        np.testing.assert_array_equal(manager.blocks[0].to_numpy(), expected)
        np.testing.assert_array_equal(got_k.to_numpy(), ref.gather(expected, LAYER, 0, slots, rows, positions))
        np.testing.assert_array_equal(got_v.to_numpy(), ref.gather(expected, LAYER, 1, slots, rows, positions))
        np.testing.assert_array_equal(layer_k.to_numpy(), got_k.to_numpy())
        np.testing.assert_array_equal(layer_v.to_numpy(), got_v.to_numpy())
        want = reference_attention(expected, LAYER, q, offsets, cache_lengths, slots, SCALE)
        np.testing.assert_allclose(got_attention.to_numpy(), want, atol=2e-5, rtol=2e-5)
        paged, lookup = _paged_copy(expected, order, [lengths[s] for s in order], rng)
        paged_out = _paged_attention(paged_model, paged, cache_lengths, lookup, q, offsets)
        np.testing.assert_allclose(got_attention.to_numpy(), paged_out, atol=1e-6, rtol=1e-6)
        for c, n in zip(contexts, new_counts, strict=True):
            if n:
                c.update(0)
        manager.step([contexts])
        assert [manager.cache_length(c.request_id) for c in contexts] == [lengths[s] for s in order]
        # Decode: one new token per sequence; lengths advance on the graph side.
        inputs = manager.increment_cache_lengths(inputs, (None, Buffer.from_numpy(offsets)))
        assert inputs[0][3].item() is False
        new_counts = np.ones(3, np.int64)


def test_reused_slot_starts_empty(collection_model, session):
    rng = np.random.default_rng(1)
    manager = ContinuousBatchingKVCacheManager(PARAMS, 2, MAX_SEQ_LEN, 2, [CPU()], session)
    old, other = manager.claim("old"), manager.claim("other")

    def prefill(request_id: str, n: int) -> np.ndarray:
        seq = manager.slot_of(request_id)
        keys = rng.standard_normal((n, 3, HEAD_DIM)).astype(np.float32)
        offsets = np.array([0, n], np.uint32)
        rows, positions = np.zeros(n, np.uint32), np.arange(n, dtype=np.uint32)
        queries = np.zeros((n, N_Q_HEADS, HEAD_DIM), np.float32)
        got_k, *_ = collection_model.execute(
            *manager.fetch([seq])[0],
            Buffer.from_numpy(keys),
            Buffer.from_numpy(keys),
            Buffer.from_numpy(offsets),
            Buffer.from_numpy(rows),
            Buffer.from_numpy(positions),
            Buffer.from_numpy(queries),
        )
        ctx = TextContext(request_id, np.zeros(n, np.int64))
        ctx.update(0)
        manager.step([[ctx]])
        return got_k.to_numpy()

    prefill("old", 9)
    manager.release("old")
    new = manager.claim("new")
    assert new == old and manager.cache_length("new") == 0
    ((_, lengths, _, empty),) = manager.fetch([new, other])
    assert lengths.to_numpy().tolist() == [0, 0] and empty.item() is True
    fresh = prefill("new", 4)
    # The new sequence's first tokens land at positions 0..3 of the reused slot.
    np.testing.assert_array_equal(manager.blocks[0].to_numpy()[new, 0, LAYER, :4], fresh)
