"""How a quantized cache stores its keys and values: 8-bit codes with float32
scales beside them.

A cache is quantized when `KVCacheParams.kvcache_quant_config` is set (MAX's
convention): `dtype` is then the *stored* 8-bit dtype (`QUANTIZED_DTYPES`) and
a float32 scales tensor sits beside the values (`KVCacheParams.scales_shape`),
one scale per `KVCacheParams.scale_block_shape` block of tokens x head_dim
elements (MAX's "per-block scales").
"""

from __future__ import annotations

from dataclasses import dataclass

from max.dtype import DType

from ..validation import check_bool, check_int

QUANTIZED_DTYPES = (DType.float8_e4m3fn, DType.int8)
"""Stored dtypes of a quantized cache: exactly these need a `kvcache_quant_config`."""

SCALE_DTYPES = (DType.float32,)
"""Scale dtypes the kernels read."""


def graph_dtype(dtype: DType) -> DType:
    """How a cache's pages of `dtype` travel through a MAX graph: float8
    codes as their uint8 bits (MAX 26.7's CPU graphs take no float8
    tensors; the kernels read the bits back as float8), anything else as
    itself."""
    return DType.uint8 if dtype == DType.float8_e4m3fn else dtype


@dataclass(frozen=True)
class KVCacheQuantConfig:
    """How a quantized cache's scales are laid out (the stored dtype is `KVCacheParams.dtype`).

    A stored element is `x / scale` converted to the stored dtype (saturated
    to its range), and the stored element times its scale is the cached key or
    value. There is one float32 scale per block of `tokens_per_scale` consecutive tokens
    of a page (or continuous slot) and `quantization_granularity` consecutive
    head_dim elements of one KV head, for keys and values of every layer.

    Args:
        scale_dtype: Dtype of the scales; only float32 is supported.
        quantization_granularity: head_dim elements sharing a scale; None (the
            default) means the whole head: one scale per token and KV head.
            Must divide head_dim (checked by `KVCacheParams`).
        tokens_per_scale: Consecutive tokens sharing a scale (1, the default:
            one per token). Must divide page_size for a paged cache (checked by
            `KVCacheParams`) and max_seq_len for a continuous one (checked by
            its manager).
        rotate_keys: Whether the cache holds keys (and attention takes
            queries) multiplied by the orthonormal Hadamard matrix of head_dim
            (`mokv.graph.rotate_heads`, applied by the model's graph before
            `store_kv` and `attention`). Scores are unchanged, but a few large
            channels spread over the whole head, so a head's scale fits its
            elements better and 8-bit keys lose less. Needs head_dim a power of
            two (checked by `KVCacheParams`); `gather_kv` then returns rotated
            keys.
    """

    scale_dtype: DType = DType.float32
    quantization_granularity: int | None = None
    tokens_per_scale: int = 1
    rotate_keys: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.scale_dtype, DType):
            raise TypeError(f"scale_dtype must be a max.dtype.DType, got {self.scale_dtype!r}")
        if self.scale_dtype not in SCALE_DTYPES:
            supported = ", ".join(d.name for d in SCALE_DTYPES)
            raise ValueError(f"scale_dtype must be one of {supported}, got {self.scale_dtype.name}")
        if self.quantization_granularity is not None:
            granularity = check_int("quantization_granularity", self.quantization_granularity, minimum=1)
            object.__setattr__(self, "quantization_granularity", granularity)
        object.__setattr__(self, "tokens_per_scale", check_int("tokens_per_scale", self.tokens_per_scale, minimum=1))
        object.__setattr__(self, "rotate_keys", check_bool("rotate_keys", self.rotate_keys))
