"""`KVCacheParams`: the shape, parallelism and policy of one KV cache.

Everything downstream (buffers, page pools, managers, graph input types) reads
its sizes from a `KVCacheParams` (one cache) or a `multi.MultiKVCacheParams`
(several caches sharing one page table), so validation happens here, once,
with errors that name the offending value.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING

from max.dtype import DType
from max.graph import DeviceRef

from ..validation import check_bool, check_int
from .quantization import QUANTIZED_DTYPES, KVCacheQuantConfig

if TYPE_CHECKING:
    from .multi import MultiKVCacheParams

_GIB = 1 << 30

SINGLE_CACHE = "cache"
"""The leaf name of a lone `KVCacheParams` in `leaves()`."""


class KVCacheStrategy(StrEnum):
    """How cache memory is laid out and handed to requests."""

    PAGED = "paged"
    """Fixed-size pages drawn from a shared pool through a lookup table."""

    CONTINUOUS = "continuous"
    """One contiguous `max_seq_len` slot per sequence."""


@dataclass(frozen=True)
class KVCacheParams:
    """Shape, parallelism and policy of one KV cache.

    Devices are grouped replica-major: with `data_parallel_degree` replicas,
    each replica owns `len(devices) // data_parallel_degree` consecutive
    devices, and its KV heads are split evenly across them (tensor parallel).

    `dtype` is the stored dtype. float32 and bfloat16 caches store keys and
    values as they are; float8_e4m3fn and int8 caches are quantized and need a
    `kvcache_quant_config` (and only they may have one).
    """

    dtype: DType
    n_kv_heads: int
    head_dim: int
    num_layers: int
    page_size: int = 128
    cache_strategy: KVCacheStrategy = KVCacheStrategy.PAGED
    enable_prefix_caching: bool = False
    data_parallel_degree: int = 1
    devices: Sequence[DeviceRef] = field(default_factory=lambda: (DeviceRef.CPU(),))
    enable_kvcache_swapping_to_host: bool = False
    host_kvcache_swap_space_gb: float | None = None
    kvcache_quant_config: KVCacheQuantConfig | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.dtype, DType):
            raise TypeError(f"dtype must be a max.dtype.DType, got {self.dtype!r}")
        for name in ("n_kv_heads", "head_dim", "num_layers", "page_size", "data_parallel_degree"):
            object.__setattr__(self, name, check_int(name, getattr(self, name), minimum=1))
        for name in ("enable_prefix_caching", "enable_kvcache_swapping_to_host"):
            check_bool(name, getattr(self, name))
        try:
            strategy = KVCacheStrategy(self.cache_strategy)
        except ValueError:
            choices = ", ".join(s.value for s in KVCacheStrategy)
            raise ValueError(f"cache_strategy must be one of {choices}, got {self.cache_strategy!r}") from None
        object.__setattr__(self, "cache_strategy", strategy)
        if isinstance(self.devices, (str, DeviceRef)) or not isinstance(self.devices, Iterable):
            raise TypeError(f"devices must be a sequence of max.graph.DeviceRef, got {self.devices!r}")
        devices = tuple(self.devices)
        object.__setattr__(self, "devices", devices)
        if not devices:
            raise ValueError("devices must name at least one device")
        for i, device in enumerate(devices):
            if not isinstance(device, DeviceRef):
                raise TypeError(f"devices[{i}] must be a max.graph.DeviceRef, got {device!r}")
        if len(devices) % self.data_parallel_degree:
            raise ValueError(
                f"{len(devices)} devices cannot be split into "
                f"data_parallel_degree={self.data_parallel_degree} equal replicas"
            )
        if self.n_kv_heads % self.tensor_parallel_degree:
            raise ValueError(
                f"n_kv_heads={self.n_kv_heads} is not divisible by the tensor parallel "
                f"degree {self.tensor_parallel_degree} ({len(devices)} devices / "
                f"{self.data_parallel_degree} replicas)"
            )
        if self.enable_prefix_caching and strategy is not KVCacheStrategy.PAGED:
            raise ValueError(f"prefix caching needs the paged strategy, got {strategy.value}")
        check_swap_space(self)
        self._check_quantization()

    def _check_quantization(self) -> None:
        """8-bit dtypes iff a quant config, whose scale blocks tile a head and a page."""
        config = self.kvcache_quant_config
        if config is not None and not isinstance(config, KVCacheQuantConfig):
            raise TypeError(
                f"kvcache_quant_config must be a mokv KVCacheQuantConfig or None, got {type(config).__name__}"
            )
        quantized_dtypes = " or ".join(d.name for d in QUANTIZED_DTYPES)
        if config is None:
            if self.dtype in QUANTIZED_DTYPES:
                raise ValueError(
                    f"dtype={self.dtype.name} stores quantized values and needs a kvcache_quant_config "
                    "(a KVCacheQuantConfig) describing their scales"
                )
            return
        if self.dtype not in QUANTIZED_DTYPES:
            raise ValueError(
                f"kvcache_quant_config is set, so dtype (the stored dtype) must be {quantized_dtypes}, "
                f"got dtype={self.dtype.name}"
            )
        granularity = config.quantization_granularity
        if granularity is not None and self.head_dim % granularity:
            raise ValueError(
                f"kvcache_quant_config.quantization_granularity={granularity} must divide head_dim={self.head_dim}"
            )
        if config.rotate_keys and self.head_dim & (self.head_dim - 1):
            raise ValueError(
                f"kvcache_quant_config.rotate_keys needs head_dim to be a power of two, got head_dim={self.head_dim}"
            )
        if self.cache_strategy is KVCacheStrategy.PAGED and self.page_size % config.tokens_per_scale:
            raise ValueError(
                f"kvcache_quant_config.tokens_per_scale={config.tokens_per_scale} must divide "
                f"page_size={self.page_size}"
            )

    @property
    def tensor_parallel_degree(self) -> int:
        """Devices per replica; each holds `n_kv_heads_per_device` heads."""
        return len(self.devices) // self.data_parallel_degree

    @property
    def n_kv_heads_per_device(self) -> int:
        """KV heads stored on each device of a replica."""
        return self.n_kv_heads // self.tensor_parallel_degree

    @property
    def devices_per_replica(self) -> list[tuple[DeviceRef, ...]]:
        """The devices of each replica, replica-major."""
        tp = self.tensor_parallel_degree
        return [tuple(self.devices[i : i + tp]) for i in range(0, len(self.devices), tp)]

    @property
    def quantized(self) -> bool:
        """Whether values are stored in 8 bits with scales (`kvcache_quant_config` is set)."""
        return self.kvcache_quant_config is not None

    @property
    def scale_block_shape(self) -> tuple[int, int]:
        """(tokens, head_dim elements) sharing one scale: `(tokens_per_scale,
        granularity)`, the granularity resolved to head_dim when the config
        leaves it None.

        Raises:
            ValueError: The cache is not quantized.
        """
        config = self._quant_config()
        return config.tokens_per_scale, config.quantization_granularity or self.head_dim

    def _quant_config(self) -> KVCacheQuantConfig:
        if self.kvcache_quant_config is None:
            raise ValueError(f"a dtype={self.dtype.name} cache is not quantized: it has no kvcache_quant_config")
        return self.kvcache_quant_config

    @property
    def _tokens_per_scale(self) -> int:
        return self.kvcache_quant_config.tokens_per_scale if self.kvcache_quant_config else 1

    @property
    def _value_bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.n_kv_heads_per_device * self.head_dim * self.dtype.size_in_bytes

    @property
    def _scale_bytes_per_row(self) -> int:
        """Bytes of one row of scales (`tokens_per_scale` tokens, all layers), 0 unquantized."""
        if self.kvcache_quant_config is None:
            return 0
        _, granularity = self.scale_block_shape
        scale_size = self.kvcache_quant_config.scale_dtype.size_in_bytes
        return 2 * self.num_layers * self.n_kv_heads_per_device * (self.head_dim // granularity) * scale_size

    @property
    def bytes_per_token(self) -> float:
        """Bytes one token's keys and values take on one device, all layers,
        scales included: a quantized cache adds its scale bytes divided by
        `tokens_per_scale` (so the figure can be fractional); an unquantized
        cache's figure is a whole number."""
        return self._value_bytes_per_token + self._scale_bytes_per_row / self._tokens_per_scale

    @property
    def bytes_per_page(self) -> int:
        """Bytes one page takes on one device (one TP shard): its values and,
        for a quantized cache, its scales (`page_size // tokens_per_scale` rows)."""
        return self.bytes_for_tokens(self.page_size)

    def bytes_for_tokens(self, tokens: int) -> int:
        """Bytes of a page (or continuous slot) of `tokens` tokens on one
        device: values plus scales (`bytes_per_page` for a page; a continuous
        slot is `max_seq_len` tokens)."""
        scale_rows = tokens // self._tokens_per_scale
        return tokens * self._value_bytes_per_token + scale_rows * self._scale_bytes_per_row

    def block_shape(self, num_pages: int, tokens_per_page: int | None = None) -> list[int]:
        """Shape of a per-device page tensor (the `blocks` graph input, MAX's
        name) holding `num_pages` pages.

        `[num_pages, 2, num_layers, page_size, n_kv_heads_per_device, head_dim]`;
        index 0 of dim 1 holds keys, 1 holds values. A paged manager's tensor
        has `num_physical_pages = total_num_pages + 1` pages (the null page).
        `tokens_per_page` replaces page_size (a continuous cache's rows are
        slots of `max_seq_len` tokens).

        Raises:
            TypeError, ValueError: `num_pages` or `tokens_per_page` is no
                positive integer.
        """
        return [
            check_int("num_pages", num_pages, minimum=1),
            2,
            self.num_layers,
            self.page_size if tokens_per_page is None else check_int("tokens_per_page", tokens_per_page, minimum=1),
            self.n_kv_heads_per_device,
            self.head_dim,
        ]

    def scales_shape(self, num_pages: int, tokens_per_page: int | None = None) -> list[int]:
        """Shape of a quantized cache's per-device scales tensor, paged like
        `block_shape(num_pages, tokens_per_page)` (same first dimension):

        `[num_pages, 2, num_layers, tokens_per_page // tokens_per_scale,
        n_kv_heads_per_device, head_dim // granularity]`, dtype
        `kvcache_quant_config.scale_dtype`. Scale `[p, kv, l, r, h, c]` belongs
        to tokens `r * tokens_per_scale ..` of page p and head_dim elements
        `c * granularity ..` of head h.

        Raises:
            ValueError: The cache is not quantized, or `tokens_per_page` is
                not a multiple of `tokens_per_scale`.
            TypeError, ValueError: A count is no positive integer.
        """
        tokens_per_scale, granularity = self.scale_block_shape
        shape = self.block_shape(num_pages, tokens_per_page)
        if shape[3] % tokens_per_scale:
            raise ValueError(
                f"kvcache_quant_config.tokens_per_scale={tokens_per_scale} must divide the {shape[3]} tokens of a page"
            )
        shape[3] //= tokens_per_scale
        shape[5] //= granularity
        return shape

    @property
    def num_host_pages(self) -> int:
        """Host pages that fit in `host_kvcache_swap_space_gb` (0 when swapping is off).

        A host page holds one page of every TP shard of a replica.
        """
        return host_pages_in_swap_space(self)

    def leaves(self) -> dict[str, KVCacheParams]:
        """The caches a manager allocates for these params: this one, named `SINGLE_CACHE`."""
        return {SINGLE_CACHE: self}


def check_swap_space(params: KVCacheParams | MultiKVCacheParams) -> None:
    """Refuses a bad swap space: when given, it must be a finite positive size
    (even with swapping off, so a NaN cannot wait for someone to turn swapping
    on), and swapping needs prefix caching."""
    gb = params.host_kvcache_swap_space_gb
    if gb is not None or params.enable_kvcache_swapping_to_host:
        valid = not isinstance(gb, bool) and isinstance(gb, (int, float)) and math.isfinite(gb) and gb > 0
        if not valid:
            raise ValueError(
                f"enable_kvcache_swapping_to_host needs a finite host_kvcache_swap_space_gb > 0, got {gb!r}"
            )
    if not params.enable_kvcache_swapping_to_host:
        return
    if not params.enable_prefix_caching:
        raise ValueError(
            "enable_kvcache_swapping_to_host only keeps prefix-cached pages, so it needs enable_prefix_caching=True"
        )


def host_pages_in_swap_space(params: KVCacheParams | MultiKVCacheParams) -> int:
    """Host pages (one page of every leaf cache and TP shard) that fit in the swap space."""
    if not params.enable_kvcache_swapping_to_host:
        return 0
    assert params.host_kvcache_swap_space_gb is not None
    host_page_bytes = params.bytes_per_page * params.tensor_parallel_degree
    return int(params.host_kvcache_swap_space_gb * _GIB) // host_page_bytes
