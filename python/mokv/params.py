"""KV cache parameters: the one description of a cache's shape and policy.

Everything downstream (buffers, block pools, managers, graph input types) reads
its sizes from a `KVCacheParams` (one cache) or a `MultiKVCacheParams` (several
caches sharing one page table, such as a target and a draft model), so
validation happens here, once, with errors that name the offending value.
MAX's own parameter objects are converted by `from_max`, which refuses what
mokv does not support.

A cache is quantized when `KVCacheParams.kvcache_quant_config` is set (MAX's
convention): `dtype` is then the *stored* 8-bit dtype (`QUANTIZED_DTYPES`) and
a float32 scales tensor sits beside the values (`scales_shape`), one scale per
`scale_block_shape` block of tokens x head_dim elements.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, TypeAlias

from max.dtype import DType
from max.graph import DeviceRef

from .validation import check_bool, check_int

_GIB = 1 << 30

SINGLE_CACHE = "cache"
"""The leaf name of a lone `KVCacheParams` in `leaves()`."""


QUANTIZED_DTYPES = (DType.float8_e4m3fn, DType.int8)
"""Stored dtypes of a quantized cache: exactly these need a `kvcache_quant_config`."""

SCALE_DTYPES = (DType.float32,)
"""Scale dtypes the kernels read."""


def graph_dtype(dtype: DType) -> DType:
    """How a cache's blocks of `dtype` travel through a MAX graph: float8
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
        _check_swap_space(self)
        self._check_quantization()

    def _check_quantization(self) -> None:
        """8-bit dtypes iff a quant config, whose blocks tile a head and a page."""
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
        return self.bytes_per_block(self.page_size)

    def bytes_per_block(self, tokens_per_block: int) -> int:
        """Bytes of one block of `tokens_per_block` tokens on one device:
        values plus scales (`bytes_per_page` for a page; a continuous slot is
        `max_seq_len` tokens)."""
        scale_rows = tokens_per_block // self._tokens_per_scale
        return tokens_per_block * self._value_bytes_per_token + scale_rows * self._scale_bytes_per_row

    def block_shape(self, num_pages: int, tokens_per_block: int | None = None) -> list[int]:
        """Shape of a per-device block tensor holding `num_pages` pages.

        `[num_pages, 2, num_layers, page_size, n_kv_heads_per_device, head_dim]`;
        index 0 of dim 1 holds keys, 1 holds values. A paged manager's tensor
        has `num_physical_pages = total_num_pages + 1` pages (the null page).
        `tokens_per_block` replaces page_size (a continuous cache's slots hold
        `max_seq_len` tokens).

        Raises:
            TypeError, ValueError: `num_pages` or `tokens_per_block` is no
                positive integer.
        """
        return [
            check_int("num_pages", num_pages, minimum=1),
            2,
            self.num_layers,
            self.page_size if tokens_per_block is None else check_int("tokens_per_block", tokens_per_block, minimum=1),
            self.n_kv_heads_per_device,
            self.head_dim,
        ]

    def scales_shape(self, num_pages: int, tokens_per_block: int | None = None) -> list[int]:
        """Shape of a quantized cache's per-device scales tensor, paged like
        `block_shape(num_pages, tokens_per_block)` (same first dimension):

        `[num_pages, 2, num_layers, tokens_per_block // tokens_per_scale,
        n_kv_heads_per_device, head_dim // granularity]`, dtype
        `kvcache_quant_config.scale_dtype`. Scale `[p, kv, l, r, h, c]` belongs
        to tokens `r * tokens_per_scale ..` of block p and head_dim elements
        `c * granularity ..` of head h.

        Raises:
            ValueError: The cache is not quantized, or `tokens_per_block` is
                not a multiple of `tokens_per_scale`.
            TypeError, ValueError: A count is no positive integer.
        """
        tokens_per_scale, granularity = self.scale_block_shape
        shape = self.block_shape(num_pages, tokens_per_block)
        if shape[3] % tokens_per_scale:
            raise ValueError(
                f"kvcache_quant_config.tokens_per_scale={tokens_per_scale} must divide the {shape[3]} tokens of a block"
            )
        shape[3] //= tokens_per_scale
        shape[5] //= granularity
        return shape

    @property
    def num_host_pages(self) -> int:
        """Host pages that fit in `host_kvcache_swap_space_gb` (0 when swapping is off).

        A host page holds one page of every TP shard of a replica.
        """
        return _num_host_pages(self)

    def leaves(self) -> dict[str, KVCacheParams]:
        """The caches a manager allocates for these params: this one, named `SINGLE_CACHE`."""
        return {SINGLE_CACHE: self}


def _check_swap_space(params: KVCacheParams | MultiKVCacheParams) -> None:
    """The swap space, when given, is a finite positive size (even with swapping
    off, so a NaN cannot wait for someone to turn swapping on)."""
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
            "enable_kvcache_swapping_to_host only keeps prefix-cached blocks, so it needs enable_prefix_caching=True"
        )


def _num_host_pages(params: KVCacheParams | MultiKVCacheParams) -> int:
    if not params.enable_kvcache_swapping_to_host:
        return 0
    assert params.host_kvcache_swap_space_gb is not None
    host_page_bytes = params.bytes_per_page * params.tensor_parallel_degree
    return int(params.host_kvcache_swap_space_gb * _GIB) // host_page_bytes


@dataclass(frozen=True)
class MultiKVCacheParams:
    """Several paged caches behind one page table (for example a target model
    and its draft model, or layer groups with different head counts).

    One manager serves them all: a request is claimed once, a block id names
    the same page in every cache's block tensor, and a prefix hit is a hit in
    all of them. So the children must agree on everything that shapes the page
    table: page size, devices and replicas, prefix caching and the host tier.
    Children may themselves be `MultiKVCacheParams` (leaf names are then
    dotted: `target.sliding`).
    """

    children: Mapping[str, KVCacheParams | MultiKVCacheParams]

    def __post_init__(self) -> None:
        if not isinstance(self.children, Mapping):
            raise TypeError(f"children must be a mapping of names to params, got {self.children!r}")
        children = dict(self.children)
        object.__setattr__(self, "children", children)
        if not children:
            raise ValueError("MultiKVCacheParams needs at least one child cache")
        for name, child in children.items():
            if not isinstance(name, str) or not name or "." in name:
                raise ValueError(f"child names must be non-empty strings without dots, got {name!r}")
            if not isinstance(child, (KVCacheParams, MultiKVCacheParams)):
                raise TypeError(
                    f"child {name!r} must be a KVCacheParams or MultiKVCacheParams, got {type(child).__name__}"
                )
        first_name, first = next(iter(children.items()))
        for field_name in _SHARED_FIELDS:
            for name, child in children.items():
                if getattr(child, field_name) != getattr(first, field_name):
                    raise ValueError(
                        f"child caches must share {field_name}: {first_name!r} has "
                        f"{getattr(first, field_name)!r}, {name!r} has {getattr(child, field_name)!r}"
                    )
        if first.cache_strategy is not KVCacheStrategy.PAGED:
            raise ValueError(f"MultiKVCacheParams needs paged caches, got {first.cache_strategy.value}")
        _check_swap_space(self)

    def _shared(self, name: str) -> Any:
        return getattr(next(iter(self.children.values())), name)

    @property
    def page_size(self) -> int:
        return self._shared("page_size")

    @property
    def cache_strategy(self) -> KVCacheStrategy:
        return self._shared("cache_strategy")

    @property
    def enable_prefix_caching(self) -> bool:
        return self._shared("enable_prefix_caching")

    @property
    def data_parallel_degree(self) -> int:
        return self._shared("data_parallel_degree")

    @property
    def devices(self) -> tuple[DeviceRef, ...]:
        return self._shared("devices")

    @property
    def enable_kvcache_swapping_to_host(self) -> bool:
        return self._shared("enable_kvcache_swapping_to_host")

    @property
    def host_kvcache_swap_space_gb(self) -> float | None:
        return self._shared("host_kvcache_swap_space_gb")

    @property
    def tensor_parallel_degree(self) -> int:
        return self._shared("tensor_parallel_degree")

    @property
    def devices_per_replica(self) -> list[tuple[DeviceRef, ...]]:
        return self._shared("devices_per_replica")

    def leaves(self) -> dict[str, KVCacheParams]:
        """Every leaf cache, in declaration order, by dotted name."""
        out: dict[str, KVCacheParams] = {}
        for name, child in self.children.items():
            if isinstance(child, KVCacheParams):
                out[name] = child
            else:
                out.update({f"{name}.{leaf}": p for leaf, p in child.leaves().items()})
        return out

    @property
    def bytes_per_page(self) -> int:
        """Bytes one block takes on one device, over every leaf cache."""
        return sum(p.bytes_per_page for p in self.leaves().values())

    @property
    def num_host_pages(self) -> int:
        """Host pages (one block of every leaf and TP shard) in the swap space."""
        return _num_host_pages(self)


_SHARED_FIELDS = (
    "page_size",
    "cache_strategy",
    "enable_prefix_caching",
    "data_parallel_degree",
    "devices",
    "enable_kvcache_swapping_to_host",
    "host_kvcache_swap_space_gb",
)
"""What children of a `MultiKVCacheParams` must agree on: it shapes the one page table."""

AnyKVCacheParams: TypeAlias = KVCacheParams | MultiKVCacheParams
"""What the paged manager accepts (after `from_max` for MAX's own params)."""


# ----------------------------------------------------------- MAX's own params

_FROM_MAX = ("dtype", "head_dim", "num_layers", "devices", "page_size", "data_parallel_degree", "n_kv_heads")
"""Fields of MAX's `MHAKVCacheParams` that become mokv fields of the same name."""

_UNSUPPORTED_BECAUSE = {
    "per_layer_buffers": "mokv keeps all layers in one block tensor per device",
    "kv_hash_algo": "mokv hashes blocks with its own verified chained hash",
    "kv_hash_seed": "mokv hashes blocks with its own verified chained hash",
    "kv_connector_config": "mokv's host tier is configured by total_num_host_pages",
    "slots_per_page": "mokv stores one slot per token",
    "speculative_method": "mokv reserves no speculative-decoding slack",
    "num_draft_tokens": "mokv reserves no speculative-decoding slack",
    "window_size": "mokv caches keep every token; pass the window to mokv.graph.attention",
    "allow_kv_head_replication": "mokv splits KV heads evenly across TP devices",
}
"""Why each MAX field that mokv cannot honour is refused when set away from its default."""

_CONVERTED = frozenset({"enable_prefix_caching", "kvcache_quant_config"})
"""MAX fields `from_max` carries over (the quant config converted to mokv's type)."""

_HARMLESS = frozenset({"enable_dp_cross_replica_prefix_copy"})
"""MAX fields that only permit something mokv never does, so any value is honoured."""


def _max_field_is_default(params: Any, f: dataclasses.Field) -> bool:
    value = getattr(params, f.name)
    if f.name == "slots_per_page":  # MAX resolves None to page_size at construction
        return value in (None, params.page_size)
    if f.name == "kv_connector_config":
        return str(getattr(value.type, "value", value.type)) == "null"
    if f.name == "allow_kv_head_replication":  # only matters when heads do not divide evenly
        return not value or params.n_kv_heads % params.tensor_parallel_degree == 0
    if f.default is not dataclasses.MISSING:
        return value == f.default
    if f.default_factory is not dataclasses.MISSING:
        return value == f.default_factory()
    return False


def _quant_config_from_max(config: Any, dtype: DType) -> KVCacheQuantConfig | None:
    """MAX's `KVCacheQuantizationConfig` on a `dtype` cache as mokv's: the
    scale dtype and the granularity carry over 1:1, each token gets its own
    scales.

    Raises:
        ValueError: A setting mokv does not support (a scale dtype other than
            float32, a config on a dtype mokv does not quantize, which MAX
            would ignore); the message names it.
    """
    if config is None:
        return None
    refused = f"MAX's kvcache_quant_config={config!r} is not supported"
    if dtype not in QUANTIZED_DTYPES:
        supported = " and ".join(d.name for d in QUANTIZED_DTYPES)
        raise ValueError(f"{refused} on dtype={dtype.name}: mokv quantizes {supported} caches")
    try:
        return KVCacheQuantConfig(
            scale_dtype=config.scale_dtype, quantization_granularity=config.quantization_granularity
        )
    except (TypeError, ValueError) as error:
        raise ValueError(f"{refused}: {error}") from None


def from_max(params: Any) -> AnyKVCacheParams:
    """Converts MAX's own cache parameters to mokv's.

    Accepts `max.nn.kv_cache.MHAKVCacheParams` (a leaf) and
    `max.nn.kv_cache.MultiKVCacheParams` (a tree of them). Every field MAX sets
    is either carried over (`dtype`, `head_dim`, `num_layers`, `n_kv_heads`,
    `page_size`, `devices`, `data_parallel_degree`, `enable_prefix_caching`,
    `kvcache_quant_config`), known to be harmless, or must hold its default.

    Raises:
        ValueError: A field mokv does not support is set, or a quantization
            setting it does not support (a scale dtype other than float32, a
            quant config on an unquantized dtype, an 8-bit dtype other than
            float8_e4m3fn / int8); the message names it.
        TypeError: `params` is no MAX parameter type mokv knows (MLA caches,
            recurrent state).
    """
    from max.nn import kv_cache as max_kv

    if isinstance(params, max_kv.MultiKVCacheParams):
        return MultiKVCacheParams({name: from_max(child) for name, child in params.children.items()})
    if not isinstance(params, max_kv.MHAKVCacheParams) or isinstance(params, max_kv.MLAKVCacheParams):
        raise TypeError(f"mokv converts MAX's MHAKVCacheParams and MultiKVCacheParams, got {type(params).__name__}")
    for f in dataclasses.fields(params):
        if f.name in _FROM_MAX or f.name in _CONVERTED or f.name in _HARMLESS:
            continue
        if not _max_field_is_default(params, f):
            reason = _UNSUPPORTED_BECAUSE.get(f.name, "mokv does not implement it")
            raise ValueError(f"MAX's {f.name}={getattr(params, f.name)!r} is not supported: {reason}")
    return KVCacheParams(
        **{name: getattr(params, name) for name in _FROM_MAX},
        enable_prefix_caching=params.enable_prefix_caching,
        kvcache_quant_config=_quant_config_from_max(params.kvcache_quant_config, params.dtype),
    )


def resolve_params(params: object) -> AnyKVCacheParams:
    """mokv params as they are; MAX's own params through `from_max`.

    Raises:
        TypeError: `params` is neither (the message names its type).
    """
    if isinstance(params, (KVCacheParams, MultiKVCacheParams)):
        return params
    if type(params).__module__.startswith("max."):
        return from_max(params)
    raise TypeError(
        f"params must be a mokv KVCacheParams / MultiKVCacheParams or MAX's MHAKVCacheParams / "
        f"MultiKVCacheParams, got {type(params).__module__}.{type(params).__qualname__}"
    )
