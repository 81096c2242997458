"""The GPU kernels of an 8-bit KV cache (`float8_e4m3fn` and `int8` codes with
float32 scales), run under the CPU emulator against the numpy model of the
CPU suite (`tests.support.kv_quantization_cases`, `mokv_reference.quant`), with
the same bounds: the store writes each granule's exact scale and the nearest
codes (requantizing a scale block's earlier tokens when its scale grows),
gathers return the codes as stored or dequantized, and attention over the
codes equals float64 attention over their numpy dequantization, with float32
or bfloat16 queries."""

from __future__ import annotations

import math

import numpy as np
import pytest
from max.dtype import DType

from mokv_reference import bfloat16
from mokv_reference import quant as ref
from tests.support import kv_quantization_cases as cpu
from tests.support.attention_plan import Case, Plan, modelled_plan
from tests.support.emulation import Emulator, cache_meta, float32_bits
from tests.support.gpu_cases import QuantizedAttention

H100_MULTIPROCESSORS = 132
KV_HEADS = 2
"""`emulate_attention`'s default."""
PREFILL_ROWS = 64
"""Query rows of an `mma.sync` prefill block (four warps of 16)."""


def _rows(values: np.ndarray, dtype: DType) -> np.ndarray:
    return bfloat16.to_bits(values) if dtype == DType.bfloat16 else np.ascontiguousarray(values, np.float32)


def _values(raw: bytes, dtype: DType, shape: tuple[int, ...]) -> np.ndarray:
    if dtype == DType.bfloat16:
        return bfloat16.from_bits(np.frombuffer(raw, np.uint16)).reshape(shape)
    return np.frombuffer(raw, np.float32).reshape(shape)


def emulate(
    emulator: Emulator,
    op: str,
    cache: cpu.Cache,
    dtype: DType,
    layer: int,
    arrays: dict[str, np.ndarray],
    output: str,
    multiprocessors: int = 1,
    tensor_cores: bool = True,
    prefill_kernel: str | None = "mma",
    **meta: object,
) -> bytes:
    """Runs `op` on `cache` (paged); `dtype` is the rows' and queries'."""
    header = cache_meta(op, "paged", dtype.name, cache.codes, layer, multiprocessors, tensor_cores, prefill_kernel) | {
        "format": cache.fmt,
        "granules": cache.scales.shape[-1],
        "tokens_per_scale": cache.tokens_per_scale,
    }
    codes = cache.codes.view(np.uint8 if cache.fmt == "float8_e4m3fn" else np.int8)
    base = {"blocks": codes, "scales": cache.scales, "lookup_table": cache.lookup_table}
    return emulator.run(header | meta, base | arrays, output)


def store(emulator, cache, dtype, layer, keys, values, cache_lengths, offsets) -> None:
    """The emulated store, its codes and scales written back into `cache`."""
    arrays = {
        "cache_lengths": cache_lengths,
        "keys": _rows(keys, dtype),
        "values": _rows(values, dtype),
        "row_offsets": offsets,
    }
    codes = emulate(emulator, "store", cache, dtype, layer, arrays, "blocks_out", tokens=len(keys))
    cache.codes[...] = np.frombuffer(codes, cache.codes.dtype).reshape(cache.codes.shape)
    scales = (emulator.workdir / f"call{emulator.calls}" / "scales_out.bin").read_bytes()
    cache.scales[...] = np.frombuffer(scales, np.float32).reshape(cache.scales.shape)


def gather(emulator, cache, dtype, layer, cache_lengths, rows, positions) -> tuple[np.ndarray, ...]:
    """(dequantized keys, key codes, key scales) of the requested rows."""
    arrays = {"cache_lengths": cache_lengths, "batch_rows": rows, "positions": positions}
    shape = (len(rows), *cache.codes.shape[4:])
    deq = _values(emulate(emulator, "gather", cache, dtype, layer, arrays, "out", kv_idx=0), dtype, shape)
    codes = emulate(emulator, "gather_codes", cache, dtype, layer, arrays, "out", kv_idx=0)
    scales = (emulator.workdir / f"call{emulator.calls}" / "scales_out.bin").read_bytes()
    return (
        deq,
        np.frombuffer(codes, cache.codes.dtype).reshape(shape),
        np.frombuffer(scales, np.float32).reshape(len(rows), shape[1], -1),
    )


@pytest.mark.parametrize("dtype", [DType.float32, DType.bfloat16], ids=lambda d: d.name)
@pytest.mark.parametrize("granules", [1, 2])
@pytest.mark.parametrize("fmt", cpu.FORMATS)
def test_store_quantizes_each_granule_to_its_nearest_codes(fmt, granules, dtype, emulator):
    """Per-token scales: a ragged batch of new rows, at arbitrary positions of
    reused pages, comes back as the nearest codes under the exact scale."""
    rng = np.random.default_rng(granules)
    heads, d, page = 3, 64, 16
    cache = cpu.empty_cache(rng, fmt, 3, 4, page, heads, d, granules, 1)
    cache_lengths = np.array([0, 17, 40], np.uint32)
    new = np.array([20, 1, 9])
    offsets = np.concatenate([[0], np.cumsum(new)]).astype(np.uint32)
    keys = (rng.standard_normal((new.sum(), heads, d)) * rng.uniform(0.01, 100, (new.sum(), 1, 1))).astype(np.float32)
    if dtype == DType.bfloat16:
        keys = bfloat16.from_bits(bfloat16.to_bits(keys))
    values = rng.standard_normal(keys.shape).astype(np.float32)
    store(emulator, cache, dtype, 1, keys, values, cache_lengths, offsets)

    rows = np.repeat(np.arange(3), new).astype(np.uint32)
    positions = np.concatenate([np.arange(c, c + n) for c, n in zip(cache_lengths, new, strict=True)]).astype(np.uint32)
    deq, codes, scales = gather(emulator, cache, dtype, 1, cache_lengths + new.astype(np.uint32), rows, positions)
    np.testing.assert_allclose(scales, ref.granule_scales(keys, d // granules, fmt), rtol=1e-6)
    cpu.assert_nearest_codes(keys, codes, scales, fmt)
    expected = ref.dequantize(codes, scales, fmt)
    if dtype == DType.bfloat16:
        expected = bfloat16.from_bits(bfloat16.to_bits(expected.astype(np.float32)))
    np.testing.assert_allclose(deq, expected, rtol=1e-6)


@pytest.mark.parametrize("head_dim", [128, 256])
@pytest.mark.parametrize("fmt", cpu.FORMATS)
def test_prefill_fills_scale_blocks_of_several_tokens(fmt, head_dim, emulator):
    """A prefill into scale blocks of 4 tokens (the store's sixteen lanes a
    granule, one or two chunks a lane): each block's scale is its new
    tokens' largest magnitude, and every code the nearest under it; the
    values are the same in both caches, the keys' scale per block."""
    rng = np.random.default_rng(head_dim)
    heads, page, per_block = 2, 8, 4
    cache = cpu.empty_cache(rng, fmt, 2, 2, page, heads, head_dim, 1, per_block)
    new = np.array([9, 5])
    offsets = np.concatenate([[0], np.cumsum(new)]).astype(np.uint32)
    keys = (rng.standard_normal((new.sum(), heads, head_dim)) * rng.uniform(0.01, 100, (new.sum(), 1, 1))).astype(
        np.float32
    )
    zero = np.zeros(2, np.uint32)
    store(emulator, cache, DType.float32, 0, keys, keys, zero, offsets)

    rows = np.repeat(np.arange(2), new).astype(np.uint32)
    positions = np.concatenate([np.arange(n) for n in new]).astype(np.uint32)
    _, codes, scales = gather(emulator, cache, DType.float32, 0, new.astype(np.uint32), rows, positions)
    expected = np.empty_like(scales)
    for start, n in zip(offsets[:-1], new, strict=True):
        for block in range(0, n, per_block):
            tokens = keys[start + block : start + min(block + per_block, n)]
            expected[start + block : start + block + len(tokens), :, 0] = (
                np.abs(tokens).max(axis=(0, 2)) / ref.CODE_MAX[fmt]
            )
    np.testing.assert_allclose(scales, expected, rtol=1e-6)
    cpu.assert_nearest_codes(keys, codes, scales, fmt)


@pytest.mark.parametrize("fmt", cpu.FORMATS)
def test_store_saturates_and_maps_nan_to_zero(fmt, emulator):
    rng = np.random.default_rng(0)
    cache = cpu.empty_cache(rng, fmt, 1, 1, 16, 1, 16, 1, 1)
    keys = np.ones((3, 1, 16), np.float32)
    keys[0, 0, :4] = [np.inf, -np.inf, np.nan, 2.0]
    keys[1] = np.nan  # nothing finite: scale 0, every code 0
    keys[2, 0, 0] = 1e30
    zero = np.zeros(1, np.uint32)
    store(emulator, cache, DType.float32, 0, keys, keys, zero, np.array([0, 3], np.uint32))
    positions = np.arange(3, dtype=np.uint32)
    deq, codes, scales = gather(emulator, cache, DType.float32, 0, np.array([3], np.uint32), zero.repeat(3), positions)
    limit = ref.CODE_MAX[fmt]
    np.testing.assert_allclose(scales[:, 0, 0], [2.0 / limit, 0.0, 1e30 / limit], rtol=1e-6)
    np.testing.assert_array_equal(ref.decode(codes[0, 0, :4], fmt), [limit, -limit, 0, limit])
    assert (ref.decode(codes[1], fmt) == 0).all() and (deq[1] == 0).all()


@pytest.mark.parametrize("fmt", cpu.FORMATS)
def test_growing_scale_block_requantizes_the_tokens_it_holds(fmt, emulator):
    """Scales per block of 4 tokens, filled one decode token at a time with
    magnitudes growing 4x per token: each token's error stays within half a
    code step under every scale it was rounded with (the CPU suite's bound)."""
    rng = np.random.default_rng(1)
    heads, d, page, per_block = 2, 32, 8, 4
    cache = cpu.empty_cache(rng, fmt, 1, 2, page, heads, d, 1, per_block)
    growth = 4.0 ** np.arange(10)
    tokens = (rng.standard_normal((10, heads, d)) * growth[:, None, None]).astype(np.float32)
    for t in range(10):
        one = tokens[t : t + 1]
        store(emulator, cache, DType.float32, 0, one, one, np.array([t], np.uint32), np.array([0, 1], np.uint32))
    positions = np.arange(10, dtype=np.uint32)
    deq, _, scales = gather(emulator, cache, DType.float32, 0, np.array([10], np.uint32), 0 * positions, positions)
    limit = ref.CODE_MAX[fmt]
    for t in range(10):
        block_start = t - t % per_block
        block_end = min(block_start + per_block, 10)
        np.testing.assert_allclose(
            scales[t, :, 0], np.abs(tokens[block_start:block_end]).max(axis=(0, 2)) / limit, rtol=1e-6
        )
        history = [np.abs(tokens[block_start : u + 1]).max(axis=(0, 2)) / limit for u in range(t, block_end)]
        allowed = sum(ref.code_step(tokens[t] / s[:, None], fmt) * s[:, None] / 2 for s in history)
        assert (np.abs(deq[t] - tokens[t]) <= allowed * 1.01 + 1e-6).all(), f"token {t}"


def emulate_attention(
    emulator: Emulator,
    case: tuple,
    multiprocessors: int,
    tensor_cores: bool,
    prefill_kernel: str | None = "mma",
    extremes: bool = False,
    kv_heads: int = KV_HEADS,
    decode_kernel: str | None = None,
    splits: str | None = None,
    rows: list[tuple[int, int]] | None = None,
) -> QuantizedAttention:
    """Decode and prefill rows (`rows` of (cached, new) tokens; by default
    `cpu.ROWS`, or their decode steps alone on a large device, so that the
    decode kernels and their splits run) over a
    quantized cache of `kv_heads` heads made for `case`; `prefill_kernel` is
    `MOKV_PREFILL_KERNEL`, `decode_kernel` `MOKV_DECODE_KERNEL`, `splits`
    `MOKV_ATTENTION_SPLITS` (None: unset).
    `extremes`: queries and value scales as `cpu.make_extreme` makes them."""
    fmt, q_dtype, group, d, page, granules, per_block = case
    rng = np.random.default_rng(d + page + granules)
    if rows is None:
        rows = cpu.ROWS if multiprocessors == 1 else [(c, 1) for c, _ in cpu.ROWS]
    cache, cached, offsets, q, summary = cpu.quantized_batch(
        rng, fmt, rows, kv_heads, group, d, page, granules, per_block, q_dtype
    )
    scale = 1 / math.sqrt(d)
    if extremes:
        q = cpu.make_extreme(rng, cache, q, q_dtype)
        scale /= cpu.EXTREME_QUERY_FACTOR
    arrays = {"cache_lengths": cached, "q": _rows(q, q_dtype), "row_offsets": offsets}
    meta = {
        "tokens": len(q),
        "n_q_heads": q.shape[1],
        "scale_bits": float32_bits(scale),
        "window": 0,
        "max_new_tokens": int(summary[0, 0]),
        "max_context": int(summary[0, 1]),
    }
    if decode_kernel is not None:
        meta["MOKV_DECODE_KERNEL"] = decode_kernel
    if splits is not None:
        meta["MOKV_ATTENTION_SPLITS"] = splits
    raw = emulate(
        emulator, "attention", cache, q_dtype, 1, arrays, "out", multiprocessors, tensor_cores, prefill_kernel, **meta
    )
    return QuantizedAttention(_values(raw, q_dtype, q.shape), cache, q, q_dtype, offsets, cached, scale)


@pytest.mark.parametrize("multiprocessors", [1, H100_MULTIPROCESSORS], ids=["unsplit", "split"])
@pytest.mark.parametrize("case", cpu.ATTENTION_CASES, ids=lambda c: "-".join(str(x) for x in c))
def test_attention_reads_codes_with_their_scales(case, multiprocessors, emulator):
    """The CUDA-core kernels, which widen codes times their scales to float32
    in registers, over the CPU suite's cases (`QuantizedAttention.assert_close`)."""
    emulate_attention(emulator, case, multiprocessors, tensor_cores=False).assert_close(tensor_cores=False)


# (format, q dtype, GQA group, head_dim, page, granules, tokens per scale): bfloat16
# queries over both formats, head_dim 64 and 128, granules of 16 to 128 codes.
TENSOR_CORE_CASES = [
    ("float8_e4m3fn", DType.bfloat16, 4, 128, 128, 2, 1),
    ("int8", DType.bfloat16, 3, 64, 16, 4, 1),
    *cpu.PER_KEY_TENSOR_CORE_CASES,
]


@pytest.mark.parametrize("multiprocessors", [1, H100_MULTIPROCESSORS], ids=["unsplit", "split"])
@pytest.mark.parametrize("case", TENSOR_CORE_CASES, ids=lambda c: "-".join(str(x) for x in c))
def test_tensor_cores_read_codes_with_their_scales(case, multiprocessors, emulator):
    """The tensor-core kernels: prefill widens each tile's codes in shared
    memory, times their scales to bfloat16, or with one scale per head row
    as they are to float16; decode with one scale per head row widens each
    warp's codes to float16 in registers as its products take them, the
    queries' and outputs' columns permuted to match
    (`QuantizedAttention.assert_close`)."""
    emulate_attention(emulator, case, multiprocessors, tensor_cores=True).assert_close(tensor_cores=True)


@pytest.mark.parametrize("multiprocessors", [1, H100_MULTIPROCESSORS], ids=["unsplit", "split"])
@pytest.mark.parametrize("case", cpu.PER_KEY_TENSOR_CORE_CASES, ids=lambda c: "-".join(str(x) for x in c))
def test_float16_products_hold_any_query_and_value_scale(case, multiprocessors, emulator):
    """One scale per head row: the tensor-core kernels multiply float16 codes
    as they are, the queries scaled per row into float16's range and each
    weight times its value scale relative to the largest such product
    (`mma.MmaThread`); queries beyond float16's range and value scales over
    nine decades, zeros among them, still give float64's attention."""
    attention = emulate_attention(emulator, case, multiprocessors, tensor_cores=True, extremes=True)
    assert np.abs(attention.q).max() > 65504, "queries beyond float16's range"
    attention.assert_close(tensor_cores=True)


@pytest.mark.parametrize(("decode_kernel", "kv_heads"), [("warp_heads", 4), ("warp_heads_8", 8)])
@pytest.mark.parametrize("splits", [None, "1"], ids=["split", "unsplit"])
@pytest.mark.parametrize("case", TENSOR_CORE_CASES, ids=lambda c: "-".join(str(x) for x in c))
def test_decode_with_one_kv_head_a_warp_reads_codes(case, splits, decode_kernel, kv_heads, emulator):
    """`MOKV_DECODE_KERNEL=warp_heads` (`=warp_heads_8`): decode rows over
    four (eight) KV heads of codes, each warp widening its own head's (in
    registers with one scale per head row, the outputs' dims permuted as its
    lanes hold them; else in shared memory times their scales), split as the
    planner cuts them or whole."""
    attention = emulate_attention(
        emulator,
        case,
        H100_MULTIPROCESSORS,
        tensor_cores=True,
        kv_heads=kv_heads,
        decode_kernel=decode_kernel,
        splits=splits,
    )
    attention.assert_close(tensor_cores=True)
    decode = "decode_mma_f16_heads" if case[5] == 1 else "decode_mma_heads"
    assert emulator.launched[0] == decode + ("8" if kv_heads == 8 else "")


@pytest.mark.parametrize(
    ("case", "rows", "kernel", "widening_blocks"),
    [
        (cpu.PER_KEY_TENSOR_CORE_CASES[2], [(512, 1), (300, 1)], "decode_mma_f16", 2),
        (cpu.PER_KEY_TENSOR_CORE_CASES[1], [(385, 128)], "prefill_mma_f16", 3),
    ],
    ids=["decode", "prefill"],
)
def test_splits_are_planned_for_the_kernel_that_runs(case, rows, kernel, widening_blocks, emulator):
    """A context is cut into the splits the planner's grid model finds
    soonest for the blocks per multiprocessor of the kernel that ran (its
    `MIN_BLOCKS`, 64-key tiles), on one multiprocessor. Over 8-bit codes
    with one scale per head row the kernels multiply float16 codes and hold
    their own count of blocks, not the `widening_blocks` of the kernels
    that widen codes in shared memory (float8's decode at head_dim 128:
    three, not two; its prefill at head_dim 64: two, not three), and each
    case is one those would cut otherwise: the tenth GPU run's float8
    decode was planned for the widening decode's two."""
    emulate_attention(emulator, case, 1, tensor_cores=True, rows=rows).assert_close(tensor_cores=True)
    launch = emulator.launches[0]
    assert launch.name == kernel

    def plan_for(blocks_per_multiprocessor: int) -> Plan:
        return modelled_plan(
            Case(
                len(rows),
                KV_HEADS,
                case[2],
                max(n for _, n in rows),
                max(c + n for c, n in rows),
                multiprocessors=1,
                decode_blocks=blocks_per_multiprocessor,
                prefill_blocks=blocks_per_multiprocessor,
                prefill_rows=PREFILL_ROWS,
            )
        )

    expected = plan_for(launch.min_blocks)
    assert plan_for(widening_blocks).splits != expected.splits, "a case the widening kernel's fit would cut alike"
    assert launch.grid_y == expected.query_tiles * expected.splits


@pytest.mark.parametrize(
    ("case", "kernel"),
    [(TENSOR_CORE_CASES[0], "prefill_mma"), (cpu.PER_KEY_TENSOR_CORE_CASES[0], "prefill_mma_f16")],
    ids=["scales-per-granule", "scale-per-row"],
)
def test_prefill_over_codes_keeps_warp_products_by_default(case, kernel, emulator, monkeypatch):
    """`MOKV_PREFILL_KERNEL` unset on a device with warpgroup products: 8-bit
    codes still take `mma.sync` (the warpgroup default is bfloat16's: no run
    has timed the prefill over codes on either)."""
    monkeypatch.delenv("MOKV_PREFILL_KERNEL", raising=False)
    attention = emulate_attention(emulator, case, 1, tensor_cores=True, prefill_kernel=None)
    attention.assert_close(tensor_cores=True)
    assert emulator.launched == [kernel]


@pytest.mark.parametrize("case", TENSOR_CORE_CASES, ids=lambda c: "-".join(str(x) for x in c))
def test_warpgroup_prefill_reads_codes_widened_to_bfloat16(case, emulator):
    """`MOKV_PREFILL_KERNEL=wgmma`: the prefill rows' products as Hopper's
    warpgroup MMA, over tiles widened times their scales to bfloat16 (with
    one scale per head row too)."""
    emulate_attention(emulator, case, 1, tensor_cores=True, prefill_kernel="wgmma").assert_close(
        tensor_cores=True, warpgroup=True
    )


@pytest.mark.parametrize("prefill_kernel", ["wgmma_producer", "wgmma_tma"])
def test_producer_fed_prefill_refuses_codes(prefill_kernel, emulator):
    """`MOKV_PREFILL_KERNEL=wgmma_producer` (or `=wgmma_tma`) over an 8-bit
    cache: refused by name (its producer copies bfloat16 rows; no kernel
    widens codes there), not run as another kernel."""
    with pytest.raises(RuntimeError, match=f"{prefill_kernel}: its producer warpgroup copies bfloat16 rows"):
        emulate_attention(emulator, TENSOR_CORE_CASES[0], 1, tensor_cores=True, prefill_kernel=prefill_kernel)
