"""The GPU kernels of store, gather and attention, run under the CPU emulator
(no GPU needed), against the same numpy references and on the same random
ragged batches as the CPU ops' tests.

The emulator runs each block's threads phase by phase, and the threads of a
block run ahead of one another between barriers (see
`mokv_kernels.gpu.block`), so these tests also catch a missing barrier; they
say nothing about speed or about anything only the hardware does. Attention
runs twice per case: on a 1-multiprocessor device (one block per query tile
and KV head) and on a 132-multiprocessor one, where the planner splits the
context (split-K) and the merge kernel combines the splits.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from max.dtype import DType

from mokv_reference import bfloat16
from mokv_reference import cache as ref
from tests.support import attention_cases as cpu_attention
from tests.support import store_gather as cpu_rows
from tests.support.attention_plan import MAX_SPLITS
from tests.support.emulation import Emulator, cache_meta, float32_bits
from tests.support.gpu_cases import assert_attention_close, mixed_case, window_case

H100_MULTIPROCESSORS = 132


# -- store and gather ---------------------------------------------------------


def _bits(array: np.ndarray, dtype: DType) -> np.ndarray:
    return array.view(np.uint16) if dtype == DType.bfloat16 else array


def emulate_store(emulator: Emulator, b: cpu_rows.Batch, layout: str, dtype: DType, layer: int) -> np.ndarray:
    """The block tensor after the emulated store."""
    meta = cache_meta("store", layout, dtype.name, b.blocks, layer) | {"tokens": len(b.keys)}
    arrays = {
        "blocks": b.blocks,
        "cache_lengths": b.cache_lengths,
        "lookup_table": b.lookup_table,
        "keys": b.keys,
        "values": b.values,
        "row_offsets": b.row_offsets,
    }
    raw = emulator.run(meta, arrays, "blocks_out")
    return np.frombuffer(raw, b.blocks.dtype).reshape(b.blocks.shape)


def emulate_gather(
    emulator: Emulator, b: cpu_rows.Batch, layout: str, dtype: DType, layer: int, kv_idx: int, rows, positions
) -> np.ndarray:
    meta = cache_meta("gather", layout, dtype.name, b.blocks, layer) | {"kv_idx": kv_idx}
    arrays = {
        "blocks": b.blocks,
        "cache_lengths": b.cache_lengths,
        "lookup_table": b.lookup_table,
        "batch_rows": np.asarray(rows, np.uint32),
        "positions": np.asarray(positions, np.uint32),
    }
    raw = emulator.run(meta, arrays, "out")
    return np.frombuffer(raw, b.blocks.dtype).reshape(len(rows), *b.blocks.shape[4:])


@pytest.mark.parametrize(("layout", "dtype", "block_len"), cpu_rows.CASES)
@pytest.mark.parametrize("seed", range(2))
def test_store_then_gather_match_numpy(layout, dtype, block_len, seed, emulator):
    rng = np.random.default_rng(seed)
    b = cpu_rows.random_batch(rng, layout, dtype, block_len)
    layer = int(rng.integers(0, cpu_rows.NUM_LAYERS))
    expected = b.blocks.copy()
    ref.store(expected, layer, b.keys, b.values, b.row_offsets, b.cache_lengths, b.lookup_table)

    stored = emulate_store(emulator, b, layout, dtype, layer)
    # Bit-exact, and nothing outside the new rows touched.
    np.testing.assert_array_equal(_bits(stored, dtype), _bits(expected, dtype))

    b.blocks = stored
    rows, positions = cpu_rows.written_positions(b)
    for kv_idx, new_rows in ((0, b.keys), (1, b.values)):
        gathered = emulate_gather(emulator, b, layout, dtype, layer, kv_idx, rows, positions)
        np.testing.assert_array_equal(_bits(gathered, dtype), _bits(new_rows, dtype))


def test_store_skips_tokens_outside_the_block_tensor(emulator):
    """On a GPU a bad page id cannot be reported before the first write: the
    tokens that map to it are skipped, every other token is stored."""
    rng = np.random.default_rng(7)
    b = cpu_rows.random_batch(rng, "paged", DType.float32, 16)
    while not b.row_offsets[-1]:
        b = cpu_rows.random_batch(rng, "paged", DType.float32, 16)
    row = int(np.flatnonzero(np.diff(b.row_offsets))[0])
    column = int(b.cache_lengths[row]) // 16
    page = int(b.lookup_table[row, column])
    expected = b.blocks.copy()
    ref.store(expected, 0, b.keys, b.values, b.row_offsets, b.cache_lengths, b.lookup_table)
    expected[page] = b.blocks[page]  # the page only that column of that row writes to
    b.lookup_table[row, column] = b.blocks.shape[0] + 10
    np.testing.assert_array_equal(emulate_store(emulator, b, "paged", DType.float32, 0), expected)


def test_gather_writes_zeros_for_rows_not_in_the_cache(emulator):
    rng = np.random.default_rng(3)
    b = cpu_rows.random_batch(rng, "continuous", DType.float32, 64)
    batch = len(b.cache_lengths)
    rows = np.array([0, batch, 0], np.uint32)  # a batch row out of range
    positions = np.array([1, 0, 64], np.uint32)  # a position past the slot
    out = emulate_gather(emulator, b, "continuous", DType.float32, 1, 0, rows, positions)
    np.testing.assert_array_equal(out[0], ref.gather(b.blocks, 1, 0, b.lookup_table, rows[:1], positions[:1])[0])
    assert not out[1:].any()


# -- attention ----------------------------------------------------------------


def emulate_attention(
    emulator: Emulator,
    b: cpu_attention.Batch,
    layer: int,
    scale: float,
    window: int = 0,
    multiprocessors: int = 1,
    bounds: tuple[int, int] | None = None,
    tensor_cores: bool = True,
    prefill_kernel: str | None = "mma",
    splits: str | None = None,
    decode_kernel: str | None = None,
) -> np.ndarray:
    """The emulated attention op's output (float32 values). `bounds` (most new
    tokens, longest context) default to the batch's own; `tensor_cores` says
    whether the emulated device has them; `prefill_kernel` is
    `MOKV_PREFILL_KERNEL`, `splits` `MOKV_ATTENTION_SPLITS`, `decode_kernel`
    `MOKV_DECODE_KERNEL` (all unset: None)."""
    new = np.diff(b.row_offsets.astype(np.int64))
    if bounds is None:
        bounds = (int(new.max()), int((b.cache_lengths + new).max()))
    meta = cache_meta(
        "attention", b.layout, b.dtype.name, b.blocks, layer, multiprocessors, tensor_cores, prefill_kernel
    ) | {
        "tokens": b.q.shape[0],
        "n_q_heads": b.q.shape[1],
        "scale_bits": float32_bits(scale),
        "window": window,
        "max_new_tokens": bounds[0],
        "max_context": bounds[1],
    }
    if splits is not None:
        meta["MOKV_ATTENTION_SPLITS"] = splits
    if decode_kernel is not None:
        meta["MOKV_DECODE_KERNEL"] = decode_kernel
    to_storage = bfloat16.to_bits if b.dtype == DType.bfloat16 else np.ascontiguousarray
    arrays = {
        "blocks": to_storage(b.blocks),
        "cache_lengths": b.cache_lengths,
        "lookup_table": b.lookup_table,
        "q": to_storage(b.q),
        "row_offsets": b.row_offsets,
    }
    raw = emulator.run(meta, arrays, "out")
    if b.dtype == DType.bfloat16:
        return bfloat16.from_bits(np.frombuffer(raw, np.uint16)).reshape(b.q.shape)
    return np.frombuffer(raw, np.float32).reshape(b.q.shape)


@pytest.mark.parametrize("multiprocessors", [1, H100_MULTIPROCESSORS], ids=["unsplit", "split"])
@pytest.mark.parametrize("case", cpu_attention.CASES, ids=cpu_attention.case_id)
def test_mixed_batch_matches_numpy(case, multiprocessors, emulator):
    b, layer, scale = mixed_case(case)
    out = emulate_attention(emulator, b, layer, scale, multiprocessors=multiprocessors)
    assert_attention_close(out, b, layer, scale)


BFLOAT16_CASES = [c for c in cpu_attention.CASES if c[1] == DType.bfloat16]


WARPGROUP_PREFILLS = ["wgmma", "wgmma_producer", "wgmma_tma"]


@pytest.mark.parametrize("prefill_kernel", WARPGROUP_PREFILLS)
@pytest.mark.parametrize("multiprocessors", [1, H100_MULTIPROCESSORS], ids=["unsplit", "split"])
@pytest.mark.parametrize("case", BFLOAT16_CASES, ids=cpu_attention.case_id)
def test_warpgroup_prefill_matches_numpy(case, multiprocessors, prefill_kernel, emulator):
    """`MOKV_PREFILL_KERNEL=wgmma`: the tensor-core prefill's products as
    Hopper's warpgroup MMA, its operands read from the swizzled tiles
    through the PTX ISA's canonical layouts (`mokv_kernels.gpu.warpgroup`);
    `=wgmma_producer`, the same products fed by a producer warpgroup
    through shared-memory barriers, whose emulated waits abort where a
    phase they wait for is not complete (`mokv_kernels.gpu.mbarrier`);
    `=wgmma_tma`, fed by tensor-map boxes that land swizzled by their
    shared-memory address as the PTX ISA says (`mokv_kernels.gpu.tensor_map`):
    page sizes 1 (a row box per key), 16 and 128 (chunk boxes, row boxes
    past a block's last key) and a continuous-batching slot."""
    b, layer, scale = mixed_case(case)
    out = emulate_attention(emulator, b, layer, scale, multiprocessors=multiprocessors, prefill_kernel=prefill_kernel)
    assert_attention_close(out, b, layer, scale)


@pytest.mark.parametrize(
    ("prefill_kernel", "tensor_cores", "kernel"),
    [
        (None, True, "prefill_wgmma"),
        ("mma", True, "prefill_mma"),
        ("wgmma", True, "prefill_wgmma"),
        ("wgmma_producer", True, "prefill_wgmma_producer"),
        ("wgmma_tma", True, "prefill_wgmma_tma"),
        (None, False, "prefill"),
    ],
    ids=["default-hopper", "mma", "wgmma", "wgmma-producer", "wgmma-tma", "default-no-tensor-cores"],
)
def test_prefill_kernel_choice(prefill_kernel, tensor_cores, kernel, emulator, monkeypatch):
    """Unset, `MOKV_PREFILL_KERNEL` takes warpgroup products over a bfloat16
    cache where the device has them (an H200 ran them 1.2x `mma.sync`,
    docs/gpu-runs.md), CUDA cores where it has no tensor cores; `mma` keeps
    `mma.sync` on Hopper."""
    monkeypatch.delenv("MOKV_PREFILL_KERNEL", raising=False)
    b, layer, scale = mixed_case(BFLOAT16_CASES[0])
    out = emulate_attention(emulator, b, layer, scale, tensor_cores=tensor_cores, prefill_kernel=prefill_kernel)
    assert_attention_close(out, b, layer, scale)
    assert emulator.launched == [kernel]


@pytest.mark.parametrize(
    ("prefill_kernel", "tensor_cores", "message"),
    [
        ("tensor", True, "MOKV_PREFILL_KERNEL=tensor: expected mma, wgmma, wgmma_producer or wgmma_tma"),
        ("wgmma", False, "MOKV_PREFILL_KERNEL=wgmma: this device has no warpgroup MMA"),
        ("wgmma_producer", False, "MOKV_PREFILL_KERNEL=wgmma_producer: this device has no warpgroup MMA"),
        ("wgmma_tma", False, "MOKV_PREFILL_KERNEL=wgmma_tma: this device has no warpgroup MMA"),
    ],
)
def test_prefill_kernel_choice_is_checked(prefill_kernel, tensor_cores, message, emulator):
    b, layer, scale = mixed_case(BFLOAT16_CASES[0])
    with pytest.raises(RuntimeError, match=message):
        emulate_attention(emulator, b, layer, scale, tensor_cores=tensor_cores, prefill_kernel=prefill_kernel)


@pytest.mark.parametrize("case", BFLOAT16_CASES, ids=cpu_attention.case_id)
def test_bfloat16_without_tensor_cores(case, emulator):
    """On a GPU without `mma.sync` (AMD's, older NVIDIA) a bfloat16 prefill
    takes the CUDA-core kernel, held to the CPU suite's tolerance."""
    b, layer, scale = mixed_case(case)
    out = emulate_attention(emulator, b, layer, scale, multiprocessors=H100_MULTIPROCESSORS, tensor_cores=False)
    cpu_attention.assert_close(out, cpu_attention.expected(b, layer, scale), b.dtype)


@pytest.mark.parametrize("dtype", [DType.float32, DType.bfloat16], ids=lambda d: d.name)
@pytest.mark.parametrize(
    ("rows", "n_q", "n_kv", "head_dim"),
    [([(6000, 1)], 8, 2, 128), ([(3000, 1), (4500, 1), (20, 1)], 32, 8, 128), ([(2000, 2), (900, 1)], 9, 3, 64)],
    ids=["one-long", "three-gqa32x8", "two-token-decode"],
)
def test_decode_split_over_the_context(rows, n_q, n_kv, head_dim, dtype, emulator):
    """Few decode rows on a large device: flash decoding splits each row's
    context over many blocks and merges them."""
    rng = np.random.default_rng(len(rows) + n_q)
    b = cpu_attention.make_batch(rng, "paged", dtype, rows, n_q, n_kv, head_dim, 16)
    scale = 1 / math.sqrt(head_dim)
    out = emulate_attention(emulator, b, 1, scale, multiprocessors=H100_MULTIPROCESSORS)
    assert_attention_close(out, b, 1, scale)


@pytest.mark.parametrize("dtype", [DType.float32, DType.bfloat16], ids=lambda d: d.name)
@pytest.mark.parametrize("splits", ["1", "3", "64"])
def test_fixed_splits(splits, dtype, emulator):
    """`MOKV_ATTENTION_SPLITS` cuts every context into that many splits (at
    most one per 256 tokens), whatever the planner would pick: decode rows
    and a prefill chunk."""
    rng = np.random.default_rng(int(splits))
    b = cpu_attention.make_batch(rng, "paged", dtype, [(3000, 1), (700, 1), (20, 1)], 32, 8, 128, 16)
    prefill = cpu_attention.make_batch(rng, "paged", dtype, [(900, 40), (10, 1)], 8, 2, 64, 16)
    for batch in (b, prefill):
        scale = 1 / math.sqrt(batch.q.shape[2])
        out = emulate_attention(emulator, batch, 1, scale, splits=splits)
        assert_attention_close(out, batch, 1, scale)


@pytest.mark.parametrize("dtype", [DType.float32, DType.bfloat16], ids=lambda d: d.name)
def test_a_context_splits_as_far_as_the_merge_takes(dtype, emulator):
    """`MAX_SPLITS` (128) splits of one 32k context, each written by its
    own block and read by its own thread of the merge."""
    rng = np.random.default_rng(128)
    b = cpu_attention.make_batch(rng, "paged", dtype, [(32767, 1)], 4, 1, 64, 64)
    out = emulate_attention(emulator, b, 1, 0.125, splits="500")
    assert_attention_close(out, b, 1, 0.125)
    attention, merge = emulator.launches
    assert (attention.grid_y, merge.name) == (MAX_SPLITS, "merge")


def test_fixed_splits_change_the_plan(emulator):
    """The variable reaches the planner: three splits of a float32 decode sum
    in another order than one block does, so the outputs differ in their
    last bits (both are within tolerance, `test_fixed_splits`)."""
    rng = np.random.default_rng(5)
    b = cpu_attention.make_batch(rng, "paged", DType.float32, [(3000, 1)], 8, 2, 64, 16)
    one, three = (emulate_attention(emulator, b, 1, 0.125, splits=n) for n in ("1", "3"))
    assert not np.array_equal(one, three)
    np.testing.assert_allclose(one, three, atol=1e-5)


@pytest.mark.parametrize("splits", ["0", "-2", "many"])
def test_fixed_splits_are_checked(splits, emulator):
    b, layer, scale = mixed_case(BFLOAT16_CASES[0])
    with pytest.raises(RuntimeError, match=f"MOKV_ATTENTION_SPLITS={splits}: expected a positive number of splits"):
        emulate_attention(emulator, b, layer, scale, splits=splits)


@pytest.mark.parametrize("tensor_cores", [True, False], ids=["tensor-cores", "cuda-cores"])
@pytest.mark.parametrize(("n_q", "n_kv", "head_dim", "new"), [(32, 8, 128, 1), (8, 1, 64, 1), (6, 3, 64, 4)])
def test_bfloat16_decode_in_one_block_per_row(n_q, n_kv, head_dim, new, tensor_cores, emulator):
    """bfloat16 decode rows, unsplit: on tensor cores each block's four
    warps score their own keys of every tile and combine their states at
    the end (groups of 4, 8 and 2 x 4 tokens); without, the CUDA-core
    decode."""
    rng = np.random.default_rng(n_q + new)
    rows = [(1000, new), (37, new), (300, new)]
    b = cpu_attention.make_batch(rng, "paged", DType.bfloat16, rows, n_q, n_kv, head_dim, 16)
    scale = 1 / math.sqrt(head_dim)
    out = emulate_attention(emulator, b, 0, scale, tensor_cores=tensor_cores)
    assert_attention_close(out, b, 0, scale, tensor_cores=tensor_cores)


@pytest.mark.parametrize("multiprocessors", [1, H100_MULTIPROCESSORS], ids=["unsplit", "split"])
@pytest.mark.parametrize(
    ("decode_kernel", "layout", "n_q", "n_kv", "head_dim", "new", "window"),
    [
        ("warp_heads", "paged", 32, 8, 128, 1, 0),
        ("warp_heads", "paged", 32, 4, 64, 1, 300),
        ("warp_heads", "continuous", 16, 4, 128, 2, 0),
        ("warp_heads_8", "paged", 32, 8, 128, 1, 0),
        ("warp_heads_8", "paged", 64, 8, 64, 1, 300),
        ("warp_heads_8", "continuous", 32, 16, 128, 2, 0),
    ],
    ids=[
        f"{heads}-{case}" for heads in ("four", "eight") for case in ("llama", "group8-window", "continuous-two-tokens")
    ],
)
def test_decode_with_one_kv_head_a_warp(
    decode_kernel, layout, n_q, n_kv, head_dim, new, window, multiprocessors, emulator
):
    """`MOKV_DECODE_KERNEL=warp_heads` (`=warp_heads_8`): a block of four
    (eight) KV heads, each warp one over the same positions of every tile
    (`mma.MmaThread.warp_heads`, `block_heads`), its query rows beside the
    other heads' and its padding rows read from the rows of zeros; rows with
    no cached token, with a context shorter than a tile, and split over a
    large device's blocks; eight's continuous cache holds two blocks of KV
    heads."""
    rng = np.random.default_rng(n_q + n_kv + head_dim + new)
    rows = [(1000, new), (37, new), (0, new), (300, new)]
    block_len = 16 if layout == "paged" else 1024  # a page, or a sequence's slot
    b = cpu_attention.make_batch(rng, layout, DType.bfloat16, rows, n_q, n_kv, head_dim, block_len)
    scale = 1 / math.sqrt(head_dim)
    out = emulate_attention(emulator, b, 0, scale, window, multiprocessors=multiprocessors, decode_kernel=decode_kernel)
    assert_attention_close(out, b, 0, scale, window)
    assert emulator.launched[0] == "decode_mma_heads" + ("8" if decode_kernel == "warp_heads_8" else "")


@pytest.mark.parametrize(
    ("decode_kernel", "n_q", "n_kv", "message"),
    [
        ("heads", 32, 8, "MOKV_DECODE_KERNEL=heads: expected warp_heads, warp_heads_8, or unset"),
        ("warp_heads", 9, 3, "MOKV_DECODE_KERNEL=warp_heads: the cache's 3 KV heads are not blocks of 4"),
        ("warp_heads_8", 16, 4, "MOKV_DECODE_KERNEL=warp_heads_8: the cache's 4 KV heads are not blocks of 8"),
    ],
)
def test_decode_kernel_choice_is_checked(decode_kernel, n_q, n_kv, message, emulator):
    rng = np.random.default_rng(3)
    b = cpu_attention.make_batch(rng, "paged", DType.bfloat16, [(100, 1)], n_q, n_kv, 64, 16)
    with pytest.raises(RuntimeError, match=message):
        emulate_attention(emulator, b, 0, 0.125, decode_kernel=decode_kernel)


def test_head_dim_256(emulator):
    rng = np.random.default_rng(256)
    b = cpu_attention.make_batch(rng, "paged", DType.float32, [(0, 40), (300, 1), (90, 33)], 4, 2, 256, 32)
    out = emulate_attention(emulator, b, 0, 1 / 16, multiprocessors=H100_MULTIPROCESSORS)
    cpu_attention.assert_close(out, cpu_attention.expected(b, 0, 1 / 16), DType.float32)


@pytest.mark.parametrize("prefill_kernel", ["mma", *WARPGROUP_PREFILLS])
@pytest.mark.parametrize("window", [0, 100])
def test_tensor_core_prefill_of_long_chunks(window, prefill_kernel, emulator):
    """Chunks of a few hundred tokens over cached prefixes, Llama's heads: the
    tensor-core prefill (warp or warpgroup products) walks tens of tiles per
    block, most of them seen in full by every row (no masking), the last
    ones masked causally, or by the window at both ends."""
    rng = np.random.default_rng(300 + window)
    b = cpu_attention.make_batch(rng, "paged", DType.bfloat16, [(700, 130), (0, 200), (64, 64)], 32, 8, 128, 16)
    scale = 1 / math.sqrt(128)
    out = emulate_attention(
        emulator, b, 1, scale, window, multiprocessors=H100_MULTIPROCESSORS, prefill_kernel=prefill_kernel
    )
    assert_attention_close(out, b, 1, scale, window)


@pytest.mark.parametrize("layout", ["paged", "continuous"])
@pytest.mark.parametrize("window", [1, 5, 100])
def test_sliding_window(layout, window, emulator):
    b = window_case(layout, window)
    out = emulate_attention(emulator, b, 1, 0.125, window, multiprocessors=H100_MULTIPROCESSORS)
    cpu_attention.assert_close(out, cpu_attention.expected(b, 1, 0.125, window), DType.float32)


@pytest.mark.parametrize("multiprocessors", [1, H100_MULTIPROCESSORS], ids=["unsplit", "split"])
def test_loose_bounds(multiprocessors, emulator):
    """Bounds above the batch's own (a continuous cache knows only its token
    count and slot length) size a larger grid, whose extra blocks find no
    work, and may split the context differently."""
    rng = np.random.default_rng(21)
    b = cpu_attention.make_batch(rng, "continuous", DType.float32, [(0, 37), (211, 1), (130, 70)], 12, 3, 64, 1536)
    out = emulate_attention(emulator, b, 0, 0.125, multiprocessors=multiprocessors, bounds=(len(b.q), 1536))
    cpu_attention.assert_close(out, cpu_attention.expected(b, 0, 0.125), DType.float32)


def test_large_scores_stay_stable(emulator):
    rng = np.random.default_rng(9)
    b = cpu_attention.make_batch(rng, "paged", DType.float32, [(3000, 1), (40, 30)], 4, 2, 64, 16)
    b.q *= 4
    out = emulate_attention(emulator, b, 0, 3.0, multiprocessors=H100_MULTIPROCESSORS)
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out, cpu_attention.expected(b, 0, 3.0), atol=5e-4, rtol=5e-4)


def test_rejects_heads_not_multiple_of_kv_heads(emulator):
    rng = np.random.default_rng(2)
    b = cpu_attention.make_batch(rng, "paged", DType.float32, [(5, 3)], 4, 3, 64, 16)
    with pytest.raises(RuntimeError, match="q has 4 heads, not a positive multiple of the cache's 3 KV heads"):
        emulate_attention(emulator, b, 0, 0.125)


@pytest.mark.parametrize("scale", [0.0, -0.125, float("nan"), float("inf")])
def test_rejects_a_scale_that_is_not_positive_and_finite(scale, emulator):
    """The kernels take a row's max of the products before scaling them
    (the scale goes into each exponent's multiply-add), which holds only
    for a positive scale; a graph can pass any scale at run time."""
    rng = np.random.default_rng(2)
    b = cpu_attention.make_batch(rng, "paged", DType.float32, [(5, 3)], 4, 2, 64, 16)
    with pytest.raises(RuntimeError, match=r"scale \S+ is not a positive finite number"):
        emulate_attention(emulator, b, 0, scale)


def test_rejects_unsupported_head_dim(emulator):
    rng = np.random.default_rng(2)
    b = cpu_attention.make_batch(rng, "paged", DType.float32, [(5, 3)], 4, 2, 96, 16)
    with pytest.raises(RuntimeError, match="head_dim 96: the GPU attention kernel takes 64, 128 or 256"):
        emulate_attention(emulator, b, 0, 0.125)
