"""ContinuousBatchingKVCacheManager's slot bookkeeping, without compiling graphs
(except the small increment graph)."""

from __future__ import annotations

import numpy as np
import pytest
from max.driver import CPU, Buffer
from max.dtype import DType

from mokv import KVCacheParams, KVCacheQuantConfig, TextContext
from mokv.continuous import ContinuousBatchingKVCacheManager
from tests.support.input_types import QUANTIZATIONS, assert_inputs_match_types

PARAMS = KVCacheParams(dtype=DType.float32, n_kv_heads=3, head_dim=8, num_layers=2)


@pytest.fixture
def manager(session) -> ContinuousBatchingKVCacheManager:
    return ContinuousBatchingKVCacheManager(PARAMS, 4, 32, 2, [CPU()], session)


def test_block_shape(manager):
    assert manager.block_shape(4) == [4, 2, 2, 32, 3, 8]
    assert list(manager.blocks[0].shape) == manager.block_shape(4)


# A quantized cache: a float32 scale per 4 tokens x 4 head_dim elements.
QUANTIZED = KVCacheParams(
    dtype=DType.int8,
    n_kv_heads=3,
    head_dim=8,
    num_layers=2,
    kvcache_quant_config=KVCacheQuantConfig(quantization_granularity=4, tokens_per_scale=4),
)


@pytest.mark.parametrize(("dtype", "config"), [(DType.float32, None), *QUANTIZATIONS.values()])
def test_estimated_memory_size_equals_allocation(dtype, config, session):
    params = KVCacheParams(dtype=dtype, n_kv_heads=3, head_dim=8, num_layers=2, kvcache_quant_config=config)
    manager = ContinuousBatchingKVCacheManager(params, 5, 16, 2, [CPU()], session)
    estimate = ContinuousBatchingKVCacheManager.estimated_memory_size(params, 5, 16, 2, [CPU()])
    assert estimate == manager.allocated_bytes()
    # Independently: 5 slots x (2 x 2 layers x 16 tokens x 3 heads x 8 dims) elements + 2 uint32 per slot,
    # and for a quantized cache 5 slots x (2 x 2 layers x 16 / tokens_per_scale rows x 3 heads x
    # 8 / granularity) float32 scales.
    scales = 0
    if config is not None:
        tokens, granularity = config.tokens_per_scale, config.quantization_granularity or 8
        scales = 5 * 2 * 2 * (16 // tokens) * 3 * (8 // granularity) * 4
    assert estimate == 5 * 2 * 2 * 16 * 3 * 8 * dtype.size_in_bytes + 5 * 2 * 4 + scales


def test_a_quantized_cache_gets_zeroed_scales_beside_its_slot_tensor(session):
    manager = ContinuousBatchingKVCacheManager(QUANTIZED, 4, 32, 2, [CPU()], session)
    assert manager.block_shape(4) == [4, 2, 2, 32, 3, 8] == list(manager.blocks[0].shape)
    assert manager.blocks[0].dtype == DType.int8
    (scales,) = manager.scales
    assert manager.scales_shape(4) == [4, 2, 2, 32 // 4, 3, 8 // 4] == list(scales.shape)
    assert scales.dtype == DType.float32 and scales.device == manager.blocks[0].device
    assert not scales.to_numpy().any()
    assert manager.buffer.scales == [scales]

    a, b = _claim(manager, "a", range(5)), _claim(manager, "b", [7, 8])
    (device,) = manager.runtime_inputs([[b, a]]).inputs
    assert device.scales is scales and device.flatten()[-1] is scales
    (types,) = manager.input_symbols()
    assert_inputs_match_types(device.flatten(), types.flatten())
    # fetch hands out the scales last, and increment_cache_lengths keeps them.
    fetched = manager.fetch([manager.slot_of("a"), manager.slot_of("b")])
    assert fetched[0][4] is scales
    offsets = Buffer.from_numpy(np.array([0, 1, 2], np.uint32))
    ((_, lengths, _, _, kept),) = manager.increment_cache_lengths(fetched, (None, offsets))
    assert kept is scales and lengths.to_numpy().tolist() == [1, 1]
    with pytest.raises(TypeError, match=r"must be \(blocks, cache_lengths, lookup_table, is_cache_empty, scales\)"):
        manager.increment_cache_lengths([fetched[0][:4]], (None, offsets))
    with pytest.raises(ValueError, match="tokens_per_scale=4 must divide max_seq_len=30"):
        ContinuousBatchingKVCacheManager(QUANTIZED, 4, 30, 2, [CPU()], session)


def test_claim_release_reuses_lowest_slot(manager):
    assert [manager.claim(r) for r in "ab"] == [0, 1]
    assert manager.claim("c") == 2
    manager.release("b")
    assert [manager.claim(r) for r in "de"] == [1, 3]
    assert manager.num_free_slots == 0 and manager.slot_of("e") == 3


def test_claiming_more_than_free_raises(manager):
    for r in "abc":
        manager.claim(r)
    with pytest.raises(ValueError, match="request 'a' is already claimed \\(slot 0\\)"):
        manager.claim("a")
    manager.claim("d")
    with pytest.raises(ValueError, match="cannot claim 'e': all 4 slots are taken"):
        manager.claim("e")
    assert manager.num_free_slots == 0


def test_release_and_fetch_of_unknown_ids_raise(manager):
    manager.claim("a")
    with pytest.raises(ValueError, match="request 'x' is not claimed"):
        manager.release("x")
    with pytest.raises(ValueError, match="sequence id 2 is not claimed"):
        manager.fetch([0, 2])
    with pytest.raises(ValueError, match="sequence id 9 is not claimed"):
        manager.fetch([9])
    with pytest.raises(ValueError, match="replica_idx=1 is out of range"):
        manager.claim("b", 1)


def _claim(manager, request_id, tokens):
    ctx = TextContext(request_id, np.asarray(tokens, np.int64))
    manager.claim(request_id)
    manager.alloc(ctx)
    return ctx


def test_fetch_reports_lengths_slots_and_emptiness(manager):
    a = _claim(manager, "a", range(5))
    _claim(manager, "b", [7])
    sa, sb = manager.slot_of("a"), manager.slot_of("b")
    ((blocks, lengths, lookup, empty),) = manager.fetch([sb, sa])
    assert blocks is manager.blocks[0]
    assert lengths.to_numpy().tolist() == [0, 0]
    assert lookup.to_numpy().tolist() == [sb, sa]
    assert empty.item() is True
    a.update(9)
    manager.step([[a]])
    ((_, lengths, _, empty),) = manager.fetch([sb, sa])
    assert lengths.to_numpy().tolist() == [0, 5]
    assert empty.item() is False
    ((_, _, _, empty),) = manager.fetch([sb])
    assert empty.item() is True


def test_runtime_inputs_follow_the_contexts(manager):
    a, b = _claim(manager, "a", range(5)), _claim(manager, "b", [7, 8])
    a.update(9)
    inputs = manager.runtime_inputs([[b, a]])
    (device,) = inputs.inputs
    assert device.blocks is manager.blocks[0]
    assert device.cache_lengths.to_numpy().tolist() == [0, 5]
    assert device.lookup_table.to_numpy().tolist() == [1, 0]
    assert device.is_cache_empty.item() is False
    assert inputs.flatten() == device.flatten()
    (fresh,) = manager.runtime_inputs([[b]]).inputs
    assert fresh.is_cache_empty.item() is True
    with pytest.raises(ValueError, match="expected one batch per replica \\(1\\), got 2"):
        manager.runtime_inputs([[a], [b]])


def test_release_resets_length_for_the_next_owner(manager):
    a = _claim(manager, "a", range(7))
    a.update(1)
    manager.step([[a]])
    assert manager.cache_length("a") == 7
    slot = manager.slot_of("a")
    manager.release("a")
    _claim(manager, "b", [1])
    assert manager.slot_of("b") == slot and manager.cache_length("b") == 0


def test_alloc_past_max_seq_len_raises(manager):
    with pytest.raises(ValueError, match="'a' needs 33 tokens of KV but a slot holds max_seq_len=32"):
        _claim(manager, "a", range(33))
    a = _claim(manager, "b", range(31))
    with pytest.raises(ValueError, match="'b' needs 33 tokens"):
        manager.alloc(a, num_steps=3)


def test_devices_must_match_the_params(session):
    with pytest.raises(ValueError, match=r"devices has 2 entries but params.devices has 1"):
        ContinuousBatchingKVCacheManager(PARAMS, 4, 32, 2, [CPU(), CPU()], session)


def test_increment_cache_lengths_adds_row_offset_deltas(manager):
    contexts = [_claim(manager, r, range(n + 1)) for r, n in (("a", 4), ("b", 0), ("c", 9))]
    for c in contexts:
        c.update(0)
    manager.step([contexts])
    a, b, c = (manager.slot_of(r) for r in "abc")
    inputs = manager.fetch([a, b, c])
    row_offsets = Buffer.from_numpy(np.array([0, 1, 3, 4], np.uint32))
    tokens = Buffer.from_numpy(np.zeros(4, np.int64))
    ((blocks, lengths, lookup, empty),) = manager.increment_cache_lengths(inputs, (tokens, row_offsets))
    assert lengths.to_numpy().tolist() == [6, 3, 11]
    assert lookup.to_numpy().tolist() == [a, b, c]
    assert empty.item() is False
    assert blocks is manager.blocks[0]
