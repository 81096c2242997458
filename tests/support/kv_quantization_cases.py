"""The quantized cache's test data and checks, shared by the CPU suite
(`tests/mojo/test_kv_quantization.py`, which states the bounds) and the GPU tests
(under the emulator and on a device): random 8-bit caches, their buffers, and the
nearest-code check of the store."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from max.driver import Buffer
from max.dtype import DType

from mokv_reference import bfloat16
from mokv_reference import quant as ref
from tests.support.quantized_graphs import NUM_LAYERS

FORMATS = ["float8_e4m3fn", "int8"]


def blocks_buffer(codes: np.ndarray, fmt: str) -> Buffer:
    return Buffer.from_numpy(np.ascontiguousarray(codes.view(np.uint8 if fmt == "float8_e4m3fn" else np.int8)))


def rows_buffer(values: np.ndarray, dtype: DType) -> Buffer:
    if dtype == DType.bfloat16:
        return Buffer.from_numpy(bfloat16.to_bits(values)).view(DType.bfloat16)
    return Buffer.from_numpy(np.ascontiguousarray(values, np.float32))


def to_numpy(out: Buffer, dtype: DType) -> np.ndarray:
    if dtype == DType.bfloat16:
        return bfloat16.from_bits(out.view(DType.uint16).to_numpy())
    return out.to_numpy()


def u32(value: int) -> Buffer:
    return Buffer.from_numpy(np.array(value, np.uint32))


@dataclass
class Cache:
    """A quantized paged cache: codes `[blocks, 2, layers, page, H, D]`
    (uint8 bits of float8, or int8) and scales `[blocks, 2, layers, page //
    tokens_per_scale, H, granules]`."""

    fmt: str
    codes: np.ndarray
    scales: np.ndarray
    lookup_table: np.ndarray

    @property
    def tokens_per_scale(self) -> int:
        return self.codes.shape[3] // self.scales.shape[3]

    def dequantized(self) -> np.ndarray:
        """The float64 values the cache holds, as the numpy model reads them."""
        scales = np.repeat(self.scales, self.tokens_per_scale, axis=3)
        return ref.dequantize(self.codes, scales, self.fmt)

    def buffers(self) -> list[Buffer]:
        return [blocks_buffer(self.codes, self.fmt), Buffer.from_numpy(self.scales)]


def empty_cache(rng, fmt, batch, pages_per_row, page, heads, head_dim, granules, tokens_per_scale) -> Cache:
    """Pages in a random order with stale codes and scales (a reused pool)."""
    num_pages = batch * pages_per_row + 2
    order = rng.permutation(num_pages)[: batch * pages_per_row]
    lookup = order.reshape(batch, pages_per_row).astype(np.uint32)
    shape = (num_pages + 1, 2, NUM_LAYERS, page, heads, head_dim)
    codes = rng.integers(0, 0x7F, size=shape, dtype=np.uint8)
    if fmt == "int8":
        codes = rng.integers(-127, 128, size=shape, dtype=np.int8)
    scales = rng.uniform(0.5, 2, (num_pages + 1, 2, NUM_LAYERS, page // tokens_per_scale, heads, granules))
    return Cache(fmt, codes, scales.astype(np.float32), lookup)


def assert_nearest_codes(x: np.ndarray, codes: np.ndarray, scales: np.ndarray, fmt: str) -> None:
    """Every code is the nearest to x / scale, up to float32 noise."""
    granularity = x.shape[-1] // scales.shape[-1]
    per_element = np.repeat(scales, granularity, axis=-1).astype(np.float64)
    scaled = np.where(per_element > 0, x / np.where(per_element > 0, per_element, 1), 0)
    got = ref.decode(codes, fmt)
    limit = ref.CODE_MAX[fmt]
    target = np.clip(np.nan_to_num(scaled, nan=0.0, posinf=limit, neginf=-limit), -limit, limit)
    error = np.abs(got - target)
    allowed = ref.code_step(target, fmt) / 2 + 1e-5 * np.abs(target) + 1e-6
    worst = np.unravel_index(np.argmax(error - allowed), error.shape)
    assert (error <= allowed).all(), f"code {got[worst]} for {target[worst]} (allowed error {allowed[worst]})"


def quantized_batch(rng, fmt, layout_rows, heads, group, d, page, granules, per_block, q_dtype):
    batch = len(layout_rows)
    cached = np.array([c for c, _ in layout_rows], np.uint32)
    new = np.array([n for _, n in layout_rows])
    pages = int(max(-(-(cached + new) // page))) + 1
    cache = empty_cache(rng, fmt, batch, pages, page, heads, d, granules, per_block)
    # Codes of N(0, 1) data: random codes under random scales.
    if fmt == "int8":
        cache.codes[...] = rng.integers(-127, 128, cache.codes.shape, dtype=np.int8)
    else:
        cache.codes[...] = ref.nearest_e4m3(rng.standard_normal(cache.codes.shape) * 100)
    cache.scales[...] = rng.uniform(0.002, 0.03, cache.scales.shape).astype(np.float32)
    q = rng.standard_normal((new.sum(), heads * group, d)).astype(np.float32)
    if q_dtype == DType.bfloat16:
        q = bfloat16.from_bits(bfloat16.to_bits(q))
    offsets = np.concatenate([[0], np.cumsum(new)]).astype(np.uint32)
    summary = np.array([[new.max(), (cached + new).max()]], np.uint32)
    return cache, cached, offsets, q, summary


EXTREME_QUERY_FACTOR = 1e6
"""What `make_extreme` multiplies queries by: a softmax scale divided by it
keeps the logits as they were."""


def make_extreme(rng, cache: Cache, q: np.ndarray, q_dtype: DType) -> np.ndarray:
    """The queries times `EXTREME_QUERY_FACTOR`, beyond float16's range, and
    (in place) the cache's value scales log-uniform over 10^-6 .. 10^3, one
    in ten 0 (a row of zeros): what the GPU's float16 products of an 8-bit
    cache with one scale per head row must hold."""
    values = cache.scales[:, 1]
    values[...] = 10 ** rng.uniform(-6, 3, values.shape)
    values[rng.random(values.shape) < 0.1] = 0
    q = q * np.float32(EXTREME_QUERY_FACTOR)
    return bfloat16.from_bits(bfloat16.to_bits(q)) if q_dtype == DType.bfloat16 else q


# (format, q dtype, GQA group, head_dim, page, granules, tokens per scale)
ATTENTION_CASES = [
    ("float8_e4m3fn", DType.float32, 3, 64, 16, 1, 1),
    ("int8", DType.float32, 3, 64, 16, 1, 1),
    ("float8_e4m3fn", DType.bfloat16, 4, 128, 128, 2, 1),
    ("int8", DType.float32, 1, 128, 32, 4, 8),
    ("float8_e4m3fn", DType.float32, 8, 64, 64, 1, 16),
]
# One scale per head row and bfloat16 queries: the GPU's float16 products.
PER_KEY_TENSOR_CORE_CASES = [
    ("int8", DType.bfloat16, 8, 128, 64, 1, 16),
    ("float8_e4m3fn", DType.bfloat16, 1, 64, 32, 1, 8),
    ("float8_e4m3fn", DType.bfloat16, 4, 128, 128, 1, 1),
]
ROWS = [(0, 37), (211, 1), (130, 70), (1500, 1), (9, 0), (700, 1)]
