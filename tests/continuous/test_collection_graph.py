"""A graph built from the manager's input_symbols() and the opaque collection:
store then gather over several steps, with increment_cache_lengths advancing the
lengths between steps, checked against the numpy cache model."""

from __future__ import annotations

import numpy as np
import pytest
from max.driver import CPU, Buffer
from max.dtype import DType
from max.graph import DeviceRef, Graph, TensorType

from mokv import KVCacheParams
from mokv.continuous import ContinuousBatchingKVCacheManager
from mokv.graph import FetchContinuousBatchingKVCacheCollection, gather_kv, store_kv
from mokv_reference import cache as ref

PARAMS = KVCacheParams(dtype=DType.float32, n_kv_heads=3, head_dim=8, num_layers=2)
MAX_SEQ_LEN = 32
LAYER = 1


@pytest.fixture(scope="module")
def collection_model(session, kernels):
    """Compiled once: (fetched cache, new K/V, row offsets, gather rows/positions) ->
    gathered (K, V) after storing into layer LAYER through the opaque collection."""
    manager = ContinuousBatchingKVCacheManager(PARAMS, 4, MAX_SEQ_LEN, 2, [CPU()], session)
    cpu = DeviceRef.CPU()
    rows = TensorType(DType.float32, ["new_tokens", 3, 8], cpu)
    index = TensorType(DType.uint32, ["n"], cpu)
    offsets = TensorType(DType.uint32, ["batch_plus_one"], cpu)
    inputs = [*manager.input_symbols()[0], rows, rows, offsets, index, index]
    with Graph("continuous_collection", input_types=inputs, custom_extensions=[kernels]) as g:
        collection = FetchContinuousBatchingKVCacheCollection(PARAMS)(*g.inputs[:4])
        keys, values, row_offsets, batch_rows, positions = (v.tensor for v in g.inputs[4:])
        store_kv(collection, LAYER, keys, values, row_offsets)
        g.output(*(gather_kv(collection, LAYER, kv, batch_rows, positions) for kv in (0, 1)))
    return session.load(g)


def _all_cached(lengths: dict[int, int], order: list[int]) -> tuple[np.ndarray, np.ndarray]:
    rows = np.concatenate([np.full(lengths[s], i) for i, s in enumerate(order)]).astype(np.uint32)
    positions = np.concatenate([np.arange(lengths[s]) for s in order]).astype(np.uint32)
    return rows, positions


def test_multistep_store_with_increment_matches_numpy(collection_model, session):
    rng = np.random.default_rng(0)
    manager = ContinuousBatchingKVCacheManager(PARAMS, 4, MAX_SEQ_LEN, 2, [CPU()], session)
    seqs = manager.claim(3)
    order = [seqs[2], seqs[0], seqs[1]]
    expected = manager.blocks[0].to_numpy().copy()
    lengths = {s: 0 for s in seqs}
    new_counts = np.array([5, 0, 3])  # a zero-new-token row in the prefill step
    inputs = manager.fetch(order)
    assert inputs[0][3].item() is True
    for step in range(4):
        offsets = np.concatenate([[0], np.cumsum(new_counts)]).astype(np.uint32)
        keys = rng.standard_normal((int(offsets[-1]), 3, 8)).astype(np.float32)
        values = rng.standard_normal(keys.shape).astype(np.float32)
        cache_lengths = np.array([lengths[s] for s in order], np.uint32)
        np.testing.assert_array_equal(inputs[0][1].to_numpy(), cache_lengths)
        ref.store(expected, LAYER, keys, values, offsets, cache_lengths, np.array(order, np.uint32))
        for s, n in zip(order, new_counts):
            lengths[s] += int(n)
        rows, positions = _all_cached(lengths, order)
        got_k, got_v = collection_model.execute(
            *inputs[0], Buffer.from_numpy(keys), Buffer.from_numpy(values), Buffer.from_numpy(offsets),
            Buffer.from_numpy(rows), Buffer.from_numpy(positions),
        )
        np.testing.assert_array_equal(manager.blocks[0].to_numpy(), expected)
        np.testing.assert_array_equal(got_k.to_numpy(), ref.gather(expected, LAYER, 0, np.array(order, np.uint32), rows, positions))
        np.testing.assert_array_equal(got_v.to_numpy(), ref.gather(expected, LAYER, 1, np.array(order, np.uint32), rows, positions))
        manager.step(dict(zip(order, new_counts.tolist())))
        # Decode: one new token per sequence; lengths advance on the graph side.
        inputs = manager.increment_cache_lengths(inputs, (None, Buffer.from_numpy(offsets)))
        assert inputs[0][3].item() is False
        new_counts = np.ones(3, np.int64)


def test_reused_slot_starts_empty(collection_model, session):
    rng = np.random.default_rng(1)
    manager = ContinuousBatchingKVCacheManager(PARAMS, 2, MAX_SEQ_LEN, 2, [CPU()], session)
    old, other = manager.claim(2)

    def prefill(seq: int, n: int) -> np.ndarray:
        keys = rng.standard_normal((n, 3, 8)).astype(np.float32)
        offsets = np.array([0, n], np.uint32)
        rows, positions = np.zeros(n, np.uint32), np.arange(n, dtype=np.uint32)
        got_k, _ = collection_model.execute(
            *manager.fetch([seq])[0], Buffer.from_numpy(keys), Buffer.from_numpy(keys),
            Buffer.from_numpy(offsets), Buffer.from_numpy(rows), Buffer.from_numpy(positions),
        )
        manager.step({seq: n})
        return got_k.to_numpy()

    prefill(old, 9)
    manager.release(old)
    (new,) = manager.claim(1)
    assert new == old and manager.cache_length(new) == 0
    (_, lengths, _, empty), = manager.fetch([new, other])
    assert lengths.to_numpy().tolist() == [0, 0] and empty.item() is True
    fresh = prefill(new, 4)
    # The new sequence's first tokens land at positions 0..3 of the reused slot.
    np.testing.assert_array_equal(manager.blocks[0].to_numpy()[new, 0, LAYER, :4], fresh)
