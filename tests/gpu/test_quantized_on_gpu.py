"""The quantized cache's ops (`float8_e4m3fn` and `int8` codes with float32
scales) in graphs on a GPU, against the CPU suite's numpy model
(`tests.support.kv_quantization_cases`): the store's scales and nearest codes,
both gathers, and attention over the codes with float32 and bfloat16 queries
against float64 attention over their numpy dequantization (bfloat16 queries on
tensor cores: rounded to bfloat16, `QuantizedAttention.assert_close`)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from max.driver import Buffer, Device
from max.dtype import DType
from max.engine import InferenceSession
from max.graph import DeviceRef

from mokv_reference import bfloat16
from mokv_reference import quant as ref
from tests.support import kv_quantization_cases as cpu
from tests.support.compile_once import compiled_together
from tests.support.gpu import needs_gpu
from tests.support.gpu_cases import QuantizedAttention, on_prefill_kernel
from tests.support.graph_families import quantized_family
from tests.support.quantized_graphs import GRAPH_DTYPE

pytestmark = needs_gpu("the quantized cache's store, gathers and attention against the numpy model")


@pytest.fixture(scope="session")
def gpu_quantized(gpu_session: InferenceSession, gpu_ref: DeviceRef, kernels):
    """`get(kind, graph dtype, model dtype)`: the store/gather or attention graph on the GPU
    (`graph_families.QUANTIZED_KEYS`); the family compiled together on first use."""
    family = quantized_family(kernels, gpu_ref)
    return compiled_together(gpu_session, family.build, family.keys)


def _on(array: np.ndarray, gpu: Device, dtype: DType = DType.float32) -> Buffer:
    return cpu.rows_buffer(array, dtype).to(gpu) if array.dtype.kind == "f" else Buffer.from_numpy(array).to(gpu)


@pytest.mark.parametrize("dtype", [DType.float32, DType.bfloat16], ids=lambda d: d.name)
@pytest.mark.parametrize("fmt", cpu.FORMATS)
def test_store_and_gathers_match_the_numpy_model(fmt, dtype, gpu_quantized, gpu: Device):
    rng = np.random.default_rng(4)
    heads, d, page, granules = 3, 64, 16, 2
    cache = cpu.empty_cache(rng, fmt, 3, 4, page, heads, d, granules, 1)
    cache_lengths = np.array([0, 17, 40], np.uint32)
    new = np.array([20, 1, 9])
    offsets = np.concatenate([[0], np.cumsum(new)]).astype(np.uint32)
    keys = (rng.standard_normal((new.sum(), heads, d)) * rng.uniform(0.01, 100, (new.sum(), 1, 1))).astype(np.float32)
    values = rng.standard_normal(keys.shape).astype(np.float32)
    if dtype == DType.bfloat16:
        keys = bfloat16.from_bits(bfloat16.to_bits(keys))
    rows = np.repeat(np.arange(3), new).astype(np.uint32)
    positions = np.concatenate([np.arange(c, c + n) for c, n in zip(cache_lengths, new, strict=True)]).astype(np.uint32)
    blocks, scales = (buffer.to(gpu) for buffer in cache.buffers())
    deq, codes, row_scales = gpu_quantized("store", GRAPH_DTYPE[fmt], dtype).execute(
        blocks,
        scales,
        _on(cache_lengths, gpu),
        _on(cache.lookup_table, gpu),
        _on(keys, gpu, dtype),
        _on(values, gpu, dtype),
        _on(offsets, gpu),
        cpu.u32(1),
        _on(rows, gpu),
        _on(positions, gpu),
    )
    row_scales = row_scales.to_numpy()
    codes = codes.to_numpy().view(cache.codes.dtype)
    np.testing.assert_allclose(row_scales, ref.granule_scales(keys, d // granules, fmt), rtol=1e-6)
    cpu.assert_nearest_codes(keys, codes, row_scales, fmt)
    np.testing.assert_allclose(
        cpu.to_numpy(deq, dtype), ref.dequantize(codes, row_scales, fmt), rtol=1e-6 if dtype == DType.float32 else 8e-3
    )


def run_attention(
    case: tuple, gpu_quantized, gpu: Device, extremes: bool = False, decode: bool = False
) -> QuantizedAttention:
    """mokv's attention on the GPU over a quantized cache made for `case`
    (`extremes`: queries and value scales as `cpu.make_extreme` makes them;
    `decode`: one new token per row, so the decode kernels run, not the
    prefill kernels that take a batch with longer chunks)."""
    fmt, q_dtype, group, d, page, granules, per_block = case
    rng = np.random.default_rng(d + page + granules)
    rows = [(cached, 1) for cached, _ in cpu.ROWS] if decode else cpu.ROWS
    cache, cached, offsets, q, summary = cpu.quantized_batch(
        rng, fmt, rows, 2, group, d, page, granules, per_block, q_dtype
    )
    scale = 1 / math.sqrt(d)
    if extremes:
        q = cpu.make_extreme(rng, cache, q, q_dtype)
        scale /= cpu.EXTREME_QUERY_FACTOR
    blocks, scales = (buffer.to(gpu) for buffer in cache.buffers())
    (out,) = gpu_quantized("attention", GRAPH_DTYPE[fmt], q_dtype).execute(
        blocks,
        scales,
        _on(cached, gpu),
        _on(cache.lookup_table, gpu),
        Buffer.from_numpy(summary),
        _on(q, gpu, q_dtype),
        _on(offsets, gpu),
        cpu.u32(1),
        Buffer.from_numpy(np.array(scale, np.float32)),
        cpu.u32(0),
    )
    return QuantizedAttention(cpu.to_numpy(out, q_dtype), cache, q, q_dtype, offsets, cached, scale)


@pytest.mark.parametrize("decode", [False, True], ids=["mixed", "decode"])
@pytest.mark.parametrize("case", cpu.ATTENTION_CASES, ids=lambda c: "-".join(str(x) for x in c))
def test_attention_reads_codes_with_their_scales(case, decode, gpu_quantized, gpu: Device):
    """A mixed batch (the prefill kernels) and its decode steps alone (the
    decode kernels); bfloat16 queries go to tensor cores on NVIDIA GPUs from
    sm_80, the GPUs this runs on."""
    run_attention(case, gpu_quantized, gpu, decode=decode).assert_close(tensor_cores=True)


@pytest.mark.parametrize(
    "case", [c for c in cpu.ATTENTION_CASES if c[1] == DType.bfloat16], ids=lambda c: "-".join(str(x) for x in c)
)
def test_warpgroup_prefill_reads_codes(case, gpu_quantized, gpu: Device, monkeypatch):
    """The prefill rows on Hopper's warpgroup products (`MOKV_PREFILL_KERNEL=wgmma`)."""
    on_prefill_kernel(monkeypatch, "wgmma", lambda: run_attention(case, gpu_quantized, gpu)).assert_close(
        tensor_cores=True, warpgroup=True
    )


@pytest.mark.parametrize("decode", [False, True], ids=["mixed", "decode"])
@pytest.mark.parametrize("extremes", [False, True], ids=["normal", "extremes"])
@pytest.mark.parametrize("case", cpu.PER_KEY_TENSOR_CORE_CASES, ids=lambda c: "-".join(str(x) for x in c))
def test_float16_products_read_codes_as_they_are(case, extremes, decode, gpu_quantized, gpu: Device):
    """One scale per head row and bfloat16 queries: float16 products of the
    codes as they are (float8 widened by the hardware's conversion), also
    with queries beyond float16's range and value scales over nine decades;
    prefill widens a tile's codes in shared memory, decode (one new token
    per row) each warp's codes in registers."""
    run_attention(case, gpu_quantized, gpu, extremes, decode).assert_close(tensor_cores=True)
