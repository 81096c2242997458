"""KV cache parameters: the one description of a cache's shape and policy.

Everything downstream (buffers, block pools, managers, graph input types) reads
its sizes from a `KVCacheParams`, so validation happens here, once, with errors
that name the offending value.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum

from max.dtype import DType
from max.graph import DeviceRef

_GIB = 1 << 30


class KVCacheStrategy(str, Enum):
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

    def __post_init__(self) -> None:
        if not isinstance(self.dtype, DType):
            raise TypeError(f"dtype must be a max.dtype.DType, got {self.dtype!r}")
        for name in ("n_kv_heads", "head_dim", "num_layers", "page_size", "data_parallel_degree"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        try:
            strategy = KVCacheStrategy(self.cache_strategy)
        except ValueError:
            choices = ", ".join(s.value for s in KVCacheStrategy)
            raise ValueError(
                f"cache_strategy must be one of {choices}, got {self.cache_strategy!r}"
            ) from None
        object.__setattr__(self, "cache_strategy", strategy)
        devices = tuple(self.devices)
        object.__setattr__(self, "devices", devices)
        if not devices:
            raise ValueError("devices must name at least one device")
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
        if self.enable_kvcache_swapping_to_host:
            gb = self.host_kvcache_swap_space_gb
            if gb is None or gb <= 0:
                raise ValueError(
                    "enable_kvcache_swapping_to_host needs host_kvcache_swap_space_gb > 0, "
                    f"got {gb!r}"
                )
            if not self.enable_prefix_caching:
                raise ValueError(
                    "enable_kvcache_swapping_to_host only keeps prefix-cached blocks, "
                    "so it needs enable_prefix_caching=True"
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
    def bytes_per_token(self) -> int:
        """Bytes one token's keys and values take on one device, all layers."""
        return (
            2
            * self.num_layers
            * self.n_kv_heads_per_device
            * self.head_dim
            * self.dtype.size_in_bytes
        )

    @property
    def bytes_per_page(self) -> int:
        """Bytes one page takes on one device (one TP shard)."""
        return self.page_size * self.bytes_per_token

    def block_shape(self, num_pages: int) -> list[int]:
        """Shape of a per-device block tensor holding `num_pages` pages.

        `[num_pages, 2, num_layers, page_size, n_kv_heads_per_device, head_dim]`;
        index 0 of dim 1 holds keys, 1 holds values. The paged manager passes
        `total_num_pages + 1` to make room for the null page.
        """
        return [
            num_pages,
            2,
            self.num_layers,
            self.page_size,
            self.n_kv_heads_per_device,
            self.head_dim,
        ]

    @property
    def num_host_pages(self) -> int:
        """Host pages that fit in `host_kvcache_swap_space_gb` (0 when swapping is off).

        A host page holds one page of every TP shard of a replica.
        """
        if not self.enable_kvcache_swapping_to_host:
            return 0
        assert self.host_kvcache_swap_space_gb is not None
        host_page_bytes = self.bytes_per_page * self.tensor_parallel_degree
        return int(self.host_kvcache_swap_space_gb * _GIB) // host_page_bytes
