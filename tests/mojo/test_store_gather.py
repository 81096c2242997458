"""The store and gather ops against the numpy cache model, on random ragged
batches over random non-contiguous page tables, for both layouts and dtypes."""

from __future__ import annotations

import numpy as np
import pytest
from max.driver import CPU, Buffer
from max.dtype import DType

from mokv import KVCacheBuffer, KVCacheParams
from mokv_reference import cache as ref
from tests.support.store_gather import (
    CASES,
    CPU_REF,
    HEAD_DIM,
    N_KV_HEADS,
    NUM_LAYERS,
    Batch,
    random_batch,
    run,
    u32,
    written_positions,
)


@pytest.mark.parametrize(("layout", "dtype", "block_len"), CASES)
@pytest.mark.parametrize("seed", range(4))
def test_store_matches_numpy_and_round_trips(layout, dtype, block_len, seed, store_gather):
    rng = np.random.default_rng(seed)
    b = random_batch(rng, layout, dtype, block_len)
    layer = int(rng.integers(0, NUM_LAYERS))
    expected = b.blocks.copy()
    ref.store(expected, layer, b.keys, b.values, b.row_offsets, b.cache_lengths, b.lookup_table)
    rows, positions = written_positions(b)

    keys, values = run(store_gather(layout, dtype), b, layout, dtype, layer, rows, positions)
    # Bit-exact, and everything outside the written rows (other layers, other
    # pages, the null page) untouched: the whole block tensor must match.
    np.testing.assert_array_equal(b.blocks, expected)
    np.testing.assert_array_equal(keys, b.keys)
    np.testing.assert_array_equal(values, b.values)
    np.testing.assert_array_equal(values, ref.gather(b.blocks, layer, 1, b.lookup_table, rows, positions))


def _batch_with_new_tokens(layout: str, seed: int) -> Batch:
    rng = np.random.default_rng(seed)
    block_len = 16 if layout == "paged" else 64
    b = random_batch(rng, layout, DType.float32, block_len)
    while not b.row_offsets[-1]:
        b = random_batch(rng, layout, DType.float32, block_len)
    return b


def test_store_rejects_page_outside_block_tensor(store_gather):
    b = _batch_with_new_tokens("paged", 7)
    row = int(np.argmax(np.diff(b.row_offsets) > 0))
    bad_page = b.blocks.shape[0] + 10
    b.lookup_table[row, int(b.cache_lengths[row]) // 16] = bad_page
    before = b.blocks.copy()
    with pytest.raises(ValueError, match=f"page id {bad_page} for token"):
        run(store_gather("paged", DType.float32), b, "paged", DType.float32, 0, *written_positions(b))
    np.testing.assert_array_equal(b.blocks, before)


def test_store_rejects_bad_layer(store_gather):
    b = _batch_with_new_tokens("continuous", 3)
    with pytest.raises(ValueError, match=f"layer_idx {NUM_LAYERS} out of range for {NUM_LAYERS} layers"):
        run(
            store_gather("continuous", DType.float32), b, "continuous", DType.float32, NUM_LAYERS, *written_positions(b)
        )


def test_continuous_rejects_slot_outside_block_tensor(store_gather):
    b = _batch_with_new_tokens("continuous", 5)
    row = int(np.argmax(np.diff(b.row_offsets) > 0))
    b.lookup_table[row] = 99
    before = b.blocks.copy()
    with pytest.raises(ValueError, match="page id 99"):
        run(store_gather("continuous", DType.float32), b, "continuous", DType.float32, 0, *written_positions(b))
    np.testing.assert_array_equal(b.blocks, before)


def test_gather_rejects_position_past_lookup_row(store_gather):
    b = _batch_with_new_tokens("paged", 11)
    rows = np.zeros(1, np.uint32)
    past_end = np.array([b.lookup_table.shape[1] * 16], np.uint32)
    with pytest.raises(ValueError, match=f"token {past_end[0]} is past"):
        run(store_gather("paged", DType.float32), b, "paged", DType.float32, 0, rows, past_end)


def test_gather_rejects_row_outside_batch(store_gather):
    b = _batch_with_new_tokens("continuous", 13)
    rows = np.array([len(b.cache_lengths)], np.uint32)
    with pytest.raises(ValueError, match=f"batch row {len(b.cache_lengths)} out of range"):
        run(store_gather("continuous", DType.float32), b, "continuous", DType.float32, 0, rows, np.zeros(1, np.uint32))


def test_store_rejects_row_offsets_longer_than_batch(store_gather):
    """Row offsets describing more sequences than the cache has rows would read
    cache lengths past the end of the batch."""
    b = _batch_with_new_tokens("paged", 17)
    positions = written_positions(b)
    b.row_offsets = np.append(b.row_offsets, b.row_offsets[-1])
    before = b.blocks.copy()
    with pytest.raises(ValueError, match=r"input_row_offsets has .* entries but the cache describes"):
        run(store_gather("paged", DType.float32), b, "paged", DType.float32, 0, *positions)
    np.testing.assert_array_equal(b.blocks, before)


def test_sequences_of_2_31_tokens_are_refused(store_gather):
    """The kernels divide positions by the page size as a multiply-high
    (`cache.divisor.Divisor`), exact below 2^31: a lookup table whose rows
    address 2^31 tokens or more is refused before anything is written, one
    page's worth fewer is served."""
    page = 2**14
    rng = np.random.default_rng(31)
    keys = rng.standard_normal((1, N_KV_HEADS, HEAD_DIM)).astype(np.float32)
    for columns, refused in ((2**31 // page - 1, False), (2**31 // page, True)):
        b = Batch(
            blocks=np.zeros((1, 2, NUM_LAYERS, page, N_KV_HEADS, HEAD_DIM), np.float32),
            cache_lengths=np.zeros(1, np.uint32),
            lookup_table=np.zeros((1, columns), np.uint32),
            row_offsets=np.array([0, 1], np.uint32),
            keys=keys,
            values=-keys,
        )
        at_zero = (np.zeros(1, np.uint32), np.zeros(1, np.uint32))
        if refused:
            with pytest.raises(ValueError, match=f"{columns} pages of {page} tokens"):
                run(store_gather("paged", DType.float32), b, "paged", DType.float32, 1, *at_zero)
            assert not b.blocks.any()
        else:
            stored = run(store_gather("paged", DType.float32), b, "paged", DType.float32, 1, *at_zero)
            np.testing.assert_array_equal(stored[0], keys)
            np.testing.assert_array_equal(stored[1], -keys)


def test_first_store_into_a_freshly_allocated_cache_keeps_every_row(store_gather):
    """MAX fills `Buffer.zeros` asynchronously; a store right after allocation
    raced the fill (half of these rows read back as zeros) until
    `KVCacheBuffer.allocate` waited for it."""
    rng = np.random.default_rng(0)
    params = KVCacheParams(DType.float32, N_KV_HEADS, HEAD_DIM, NUM_LAYERS, page_size=16)
    tokens = 2048
    pages = tokens // 16
    lookup = rng.permutation(4 * pages)[: 2 * (pages // 2)].astype(np.uint32).reshape(2, pages // 2)
    keys, values = (rng.standard_normal((tokens, N_KV_HEADS, HEAD_DIM)).astype(np.float32) for _ in range(2))
    rows = np.repeat(np.arange(2), tokens // 2).astype(np.uint32)
    positions = np.tile(np.arange(tokens // 2), 2).astype(np.uint32)
    model = store_gather("paged", DType.float32)
    inputs = [
        Buffer.from_numpy(np.zeros(2, np.uint32)),
        Buffer.from_numpy(lookup),
        Buffer.from_numpy(np.zeros((1, 2), np.uint32)),
        Buffer.from_numpy(keys),
        Buffer.from_numpy(values),
        Buffer.from_numpy(np.array([0, tokens // 2, tokens], np.uint32)),
        u32(1),
        Buffer.from_numpy(rows),
        Buffer.from_numpy(positions),
    ]
    buffer = KVCacheBuffer.allocate(params, 4 * pages, [CPU_REF])  # the store follows at once
    model.execute(buffer.values[0], *inputs)
    CPU().synchronize()  # whatever the driver still had queued has landed
    blocks = buffer.values[0].to_numpy()
    np.testing.assert_array_equal(ref.gather(blocks, 1, 0, lookup, rows, positions), keys)
    np.testing.assert_array_equal(ref.gather(blocks, 1, 1, lookup, rows, positions), values)
