"""ContinuousBatchingKVCacheManager's slot bookkeeping, without compiling graphs
(except the small increment graph)."""

from __future__ import annotations

import numpy as np
import pytest
from max.driver import CPU, Buffer
from max.dtype import DType

from mokv import KVCacheParams
from mokv.continuous import ContinuousBatchingKVCacheManager

PARAMS = KVCacheParams(dtype=DType.float32, n_kv_heads=3, head_dim=8, num_layers=2)


@pytest.fixture
def manager(session) -> ContinuousBatchingKVCacheManager:
    return ContinuousBatchingKVCacheManager(PARAMS, 4, 32, 2, [CPU()], session)


def test_block_shape(manager):
    assert manager.block_shape(4) == [4, 2, 2, 32, 3, 8]
    assert list(manager.blocks[0].shape) == manager.block_shape(4)


@pytest.mark.parametrize("dtype", [DType.float32, DType.bfloat16])
def test_estimated_memory_size_equals_allocation(dtype, session):
    params = KVCacheParams(dtype=dtype, n_kv_heads=3, head_dim=8, num_layers=2)
    manager = ContinuousBatchingKVCacheManager(params, 5, 16, 2, [CPU()], session)
    estimate = ContinuousBatchingKVCacheManager.estimated_memory_size(params, 5, 16, 2, [CPU()])
    assert estimate == manager.allocated_bytes()
    # Independently: 5 slots x (2 x 2 layers x 16 tokens x 3 heads x 8 dims) elements + 2 uint32 per slot.
    assert estimate == 5 * 2 * 2 * 16 * 3 * 8 * dtype.size_in_bytes + 5 * 2 * 4


def test_claim_release_reuses_lowest_slot(manager):
    assert manager.claim(2) == [0, 1]
    assert manager.claim(1) == [2]
    manager.release(1)
    assert manager.claim(2) == [1, 3]
    assert manager.num_free_slots == 0


def test_claiming_more_than_free_raises(manager):
    manager.claim(3)
    with pytest.raises(ValueError, match="cannot claim 2 sequences: only 1 of 4 slots are free"):
        manager.claim(2)
    assert manager.num_free_slots == 1


def test_release_and_fetch_of_unknown_ids_raise(manager):
    manager.claim(1)
    with pytest.raises(ValueError, match="sequence id 3 is not claimed"):
        manager.release(3)
    with pytest.raises(ValueError, match="sequence id 2 is not claimed"):
        manager.fetch([0, 2])
    with pytest.raises(ValueError, match="sequence id 9 is not claimed"):
        manager.fetch([9])


def test_fetch_reports_lengths_slots_and_emptiness(manager):
    a, b = manager.claim(2)
    (blocks, lengths, lookup, empty), = manager.fetch([b, a])
    assert blocks is manager.blocks[0]
    assert lengths.to_numpy().tolist() == [0, 0]
    assert lookup.to_numpy().tolist() == [b, a]
    assert empty.item() is True
    manager.step({a: 5})
    (_, lengths, _, empty), = manager.fetch([b, a])
    assert lengths.to_numpy().tolist() == [0, 5]
    assert empty.item() is False
    (_, _, _, empty), = manager.fetch([b])
    assert empty.item() is True


def test_release_resets_length_for_the_next_owner(manager):
    (seq,) = manager.claim(1)
    manager.step({seq: 7})
    manager.release(seq)
    (again,) = manager.claim(1)
    assert again == seq
    assert manager.cache_length(again) == 0


def test_step_past_max_seq_len_raises_and_changes_nothing(manager):
    a, b = manager.claim(2)
    manager.step({a: 30})
    with pytest.raises(ValueError, match=f"sequence {a} would hold 33 tokens .* max_seq_len=32"):
        manager.step({b: 1, a: 3})
    assert (manager.cache_length(a), manager.cache_length(b)) == (30, 0)


def test_increment_cache_lengths_adds_row_offset_deltas(manager):
    a, b, c = manager.claim(3)
    manager.step({a: 4, b: 0, c: 9})
    inputs = manager.fetch([a, b, c])
    row_offsets = Buffer.from_numpy(np.array([0, 1, 3, 4], np.uint32))
    tokens = Buffer.from_numpy(np.zeros(4, np.int64))
    (blocks, lengths, lookup, empty), = manager.increment_cache_lengths(inputs, (tokens, row_offsets))
    assert lengths.to_numpy().tolist() == [5, 2, 10]
    assert lookup.to_numpy().tolist() == [a, b, c]
    assert empty.item() is False
    assert blocks is manager.blocks[0]
