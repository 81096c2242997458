"""The attention benchmarks' workload: the shapes they time (decode and prefill, on the CPU and
on a GPU) and each case's data, a paged cache and queries shared by every kernel timed on it.

Shapes follow FlashInfer's decode benchmark scaled to the machine: Llama-style 32 query / 8 KV
heads of 128 and SmolLM2's 9 / 3 heads of 64, pages of 16 and 128 tokens, several batch sizes
and contexts, plus prefill chunks on a cached prefix. Used by `mokv bench attention` (mokv
against MAX, and the KV formats side by side) and `mokv bench kernels` (mokv against a git
revision of itself)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from types import ModuleType

import numpy as np
from max.driver import CPU, Buffer, Device
from max.dtype import DType

from mokv_examples.bench.references import reference

NUM_LAYERS = 1
LLAMA = (32, 8, 128)  # query heads, KV heads, head_dim
SMOLLM2 = (9, 3, 64)
ONE_KV_HEAD = (4, 1, 128)
"""Llama's group of four query heads over a single KV head of 128: that head's rows lie back to
back in each page, as a head-major page layout (FlashInfer's HND) would lay every head's. A
probe, not a model's shape: timed beside Llama's heads at the same bytes, it says whether the
cache's layout (each token's heads side by side) bounds the decode's KV read."""


def bfloat16_codec() -> ModuleType:
    """numpy's missing bfloat16, as the reference package converts it (round to nearest even):
    the cases' bfloat16 data is made with it. Commands call it first, to stop early where the
    reference package is missing."""
    return reference("bfloat16", "mokv bench attention and mokv bench kernels make their bfloat16 data with its codec")


@dataclass(frozen=True)
class Case:
    """One timed configuration: `batch` sequences of `context` tokens each,
    the last `new_tokens` of which are this step's queries."""

    phase: str  # "decode" or "prefill"
    dtype: DType
    heads: tuple[int, int, int]
    page_size: int
    batch: int
    context: int
    new_tokens: int = 1

    @property
    def name(self) -> str:
        hq, hkv, d = self.heads
        shape = f"b{self.batch}-ctx{self.context}" + (f"-new{self.new_tokens}" if self.phase == "prefill" else "")
        return f"{self.phase}-{self.dtype.name}-{hq}x{hkv}x{d}-page{self.page_size}-{shape}"

    @property
    def kv_bytes(self) -> int:
        """K and V bytes one call must read: every sequence's whole context."""
        _, hkv, d = self.heads
        return self.batch * self.context * 2 * hkv * d * self.dtype.size_in_bytes

    @property
    def softmax_scale(self) -> float:
        return 1 / math.sqrt(self.heads[2])


def full_cases() -> list[Case]:
    decode_shapes = [(1, 512), (1, 8192), (4, 8192), (16, 512), (16, 2048), (64, 512), (64, 2048)]
    cases = [
        Case("decode", dtype, heads, page, batch, context)
        for dtype in (DType.float32, DType.bfloat16)
        for heads in (LLAMA, SMOLLM2)
        for page in (16, 128)
        for batch, context in decode_shapes
    ]
    # (cached prefix, chunk); the 16-token chunk (a speculative-decoding
    # verify step) makes few, long work items that only split-K spreads out.
    prefill_shapes = [(0, 2048), (2048, 512), (4096, 128), (4096, 16)]
    cases += [
        Case("prefill", DType.float32, heads, 128, 1, cached + chunk, chunk)
        for heads in (LLAMA, SMOLLM2)
        for cached, chunk in prefill_shapes
    ]
    # MAX's bfloat16 prefill kernel is slow enough on the CPU that a long bfloat16 prompt
    # would take most of the run, so bfloat16 prefill gets one short chunk.
    cases += [Case("prefill", DType.bfloat16, heads, 128, 1, 2048 + 128, 128) for heads in (LLAMA, SMOLLM2)]
    return cases


def quick_cases() -> list[Case]:
    """One MAX graph per dtype (Llama heads, page 128): MAX's compile dominates."""
    return [
        Case("decode", DType.float32, LLAMA, 128, 16, 2048),
        Case("decode", DType.bfloat16, LLAMA, 128, 16, 2048),
        Case("decode", DType.float32, LLAMA, 128, 1, 8192),
        Case("prefill", DType.float32, LLAMA, 128, 1, 2048 + 512, 512),
    ]


GPU_KV_TOKEN_LIMIT = 1 << 20
"""Most context tokens in one decode case (4 GiB of bfloat16 Llama KV, which
the host builds as float32 first)."""


def gpu_full_cases() -> list[Case]:
    decode = [
        Case("decode", DType.bfloat16, heads, 128, batch, context)
        for heads in (LLAMA, SMOLLM2)
        for batch in (1, 8, 32, 128)
        for context in (1024, 8192, 32768)
        if batch * context <= GPU_KV_TOKEN_LIMIT
    ]
    decode += [Case("decode", DType.bfloat16, LLAMA, 16, batch, 4096) for batch in (1, 32)]
    decode += [Case("decode", DType.float32, LLAMA, 128, batch, 8192) for batch in (1, 32)]
    # (cached prefix, chunk)
    prefill = [(0, 512), (0, 2048), (0, 8192), (8192, 512), (8192, 2048), (24576, 8192)]
    return decode + [Case("prefill", DType.bfloat16, LLAMA, 128, 1, cached + chunk, chunk) for cached, chunk in prefill]


def gpu_quick_cases() -> list[Case]:
    """Llama heads in bfloat16, page 128: one MAX graph."""
    return [
        Case("decode", DType.bfloat16, LLAMA, 128, 1, 32768),
        Case("decode", DType.bfloat16, LLAMA, 128, 32, 4096),
        Case("decode", DType.bfloat16, LLAMA, 128, 128, 1024),
        Case("prefill", DType.bfloat16, LLAMA, 128, 1, 2048, 2048),
        Case("prefill", DType.bfloat16, LLAMA, 128, 1, 8192 + 512, 512),
    ]


def shape_fields(heads: tuple[int, int, int], page_size: int, batch: int, context: int) -> dict[str, int]:
    """A case's shape as JSON row fields."""
    hq, hkv, d = heads
    return {
        "n_q_heads": hq,
        "n_kv_heads": hkv,
        "head_dim": d,
        "page_size": page_size,
        "batch": batch,
        "context": context,
    }


def bfloat16_exact(values: np.ndarray) -> np.ndarray:
    """`values` rounded to the float32 values bfloat16 holds exactly, so a float32 and a
    bfloat16 copy hold the same numbers."""
    codec = bfloat16_codec()
    return codec.from_bits(codec.to_bits(values))


def _fill(shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """Random-looking N(0, 1) float32 data of any size, fast: one random stretch tiled,
    bfloat16-exact."""
    size = math.prod(shape)
    pattern = bfloat16_exact(rng.standard_normal(min(size, 1 << 20), dtype=np.float32))
    return np.resize(pattern, size).reshape(shape)


def to_device(host: Buffer, device: Device | None) -> Buffer:
    """`host` copied to `device` (as it is when that is the CPU or none is given)."""
    return host if device is None or device.is_host else host.to(device)


def device_buffer(values: np.ndarray, dtype: DType, device: Device | None = None) -> Buffer:
    """float32 `values` as a buffer of `dtype` (float32 or bfloat16) on `device` (the CPU
    unless given)."""
    if dtype == DType.bfloat16:
        host = Buffer.from_numpy(bfloat16_codec().to_bits(values)).view(DType.bfloat16)
    else:
        host = Buffer.from_numpy(values)
    return to_device(host, device)


def to_float(out: Buffer, dtype: DType) -> np.ndarray:
    """A kernel's output as numpy floats (bfloat16 as exact float32 values)."""
    if dtype == DType.bfloat16:
        return bfloat16_codec().from_bits(out.view(DType.uint16).to_numpy())
    return out.to_numpy()


@dataclass
class Inputs:
    """One case's data in one storage dtype, shared by every kernel timed on it; `pages`
    (the page tensor) and `q` on `device`."""

    pages: Buffer
    q: Buffer
    cache_lengths: np.ndarray
    lookup_table: np.ndarray
    row_offsets: np.ndarray
    max_lengths: np.ndarray
    device: Device

    def mokv_args(self, scale: float) -> list[Buffer]:
        """mokv's graph inputs: the paged cache (its `max_lengths` summary on
        the host, the rest on the device), then q, offsets and scale."""

        def on_device(array: np.ndarray) -> Buffer:
            return to_device(Buffer.from_numpy(array), self.device)

        return [
            self.pages,
            on_device(self.cache_lengths),
            on_device(self.lookup_table),
            Buffer.from_numpy(self.max_lengths),
            self.q,
            on_device(self.row_offsets),
            Buffer.from_numpy(np.array(scale, np.float32)),
        ]


def make_inputs(
    case: Case, rng: np.random.Generator, dtypes: tuple[DType, ...], device: Device | None = None
) -> dict[DType, Inputs]:
    """The case's cache and queries in each of `dtypes` (same values), on
    `device` (the CPU unless given). Every sequence's pages are drawn at
    random from a shared pool (MAX's null page last), so consecutive pages of
    a sequence are not adjacent in memory."""
    device = device or CPU()
    hq, hkv, d = case.heads
    pages_per_seq = -(-case.context // case.page_size)
    num_pages = case.batch * pages_per_seq
    lookup = rng.permutation(num_pages).astype(np.uint32).reshape(case.batch, pages_per_seq)
    pages = _fill((num_pages + 1, 2, NUM_LAYERS, case.page_size, hkv, d), rng)
    q = _fill((case.batch * case.new_tokens, hq, d), rng)
    cache_lengths = np.full(case.batch, case.context - case.new_tokens, np.uint32)
    row_offsets = (np.arange(case.batch + 1) * case.new_tokens).astype(np.uint32)
    max_lengths = np.array([[case.new_tokens, case.context]], np.uint32)
    return {
        dtype: Inputs(
            device_buffer(pages, dtype, device),
            device_buffer(q, dtype, device),
            cache_lengths,
            lookup,
            row_offsets,
            max_lengths,
            device,
        )
        for dtype in dtypes
    }
