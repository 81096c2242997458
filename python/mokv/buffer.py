"""The memory behind one data-parallel replica's KV cache.

`KVCacheBuffer` holds one page tensor per tensor-parallel shard (plus, for a
quantized cache, one float32 scales tensor per shard, paged like the pages:
`KVCacheParams.scales_shape`). `to_memory()` re-views every tensor as raw pages,
`[num_physical_pages, bytes_per_page]` uint8, so code that moves pages between
tiers (the host tier, a transfer engine) never needs to know dtypes or layouts.

Page counts follow the contract (`mokv.contract`): `total_num_pages` counts
the pages requests can hold; `num_physical_pages` counts every page of the
tensor, the paged cache's trailing null page included.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from max.driver import Buffer, Device
from max.dtype import DType
from max.graph import DeviceRef

from .params import KVCacheParams, graph_dtype
from .validation import allocate, check_bool, check_fits, check_int


def _device(i: int, ref: object) -> Device:
    if not isinstance(ref, DeviceRef):
        raise TypeError(f"devices[{i}] must be a max.graph.DeviceRef, got {ref!r}")
    return ref.to_device()


def _check_buffers(what: str, buffers: object) -> None:
    if not isinstance(buffers, (list, tuple)):
        raise TypeError(f"{what} must be a list of max.driver.Buffer, got {buffers!r}")
    for i, b in enumerate(buffers):
        if not isinstance(b, Buffer):
            raise TypeError(f"{what}[{i}] must be a max.driver.Buffer, got {type(b).__name__}")


def _check_page_view(buffer: Buffer, what: str) -> None:
    if not isinstance(buffer, Buffer):
        raise TypeError(f"{what} must be a max.driver.Buffer, got {type(buffer).__name__}")
    if buffer.dtype != DType.uint8 or buffer.rank != 2:
        raise ValueError(
            f"{what} must be a 2-D uint8 [num_physical_pages, bytes_per_page] buffer, "
            f"got {buffer.dtype} with shape {tuple(buffer.shape)}"
        )


def _as_pages(buffer: Buffer) -> Buffer:
    """Views `buffer` as `[num_physical_pages, bytes_per_page]` uint8 (dim 0 = pages)."""
    num_pages = buffer.shape[0]
    page_bytes = buffer.num_elements * buffer.dtype.size_in_bytes // num_pages
    return buffer.view(DType.uint8, [num_pages, page_bytes])


def graph_view(blocks: Buffer) -> Buffer:
    """A page tensor as graphs take it (`graph_dtype`): float8 codes viewed
    as their uint8 bits, anything else as it is."""
    dtype = graph_dtype(blocks.dtype)
    return blocks if dtype == blocks.dtype else blocks.view(dtype)


@dataclass(frozen=True)
class KVCacheMemory:
    """One tensor's pages as raw bytes: `[num_physical_pages, bytes_per_page]` uint8."""

    buffer: Buffer

    def __post_init__(self) -> None:
        _check_page_view(self.buffer, "KVCacheMemory.buffer")

    @property
    def num_physical_pages(self) -> int:
        """Pages in the tensor, a null page included."""
        return self.buffer.shape[0]

    @property
    def bytes_per_page(self) -> int:
        """Bytes of one page."""
        return self.buffer.shape[1]

    @property
    def copies(self) -> list[Buffer]:
        """Every buffer a restored page must be written to."""
        return [self.buffer]


@dataclass(frozen=True)
class ReplicatedKVCacheMemory(KVCacheMemory):
    """Identical TP shards kept as one unit: read `buffer`, write all `copies`."""

    peers: list[Buffer] = field(default_factory=list)

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.peers:
            raise ValueError("ReplicatedKVCacheMemory needs at least one peer buffer")
        for i, peer in enumerate(self.peers):
            _check_page_view(peer, f"peer {i}")
            if peer.shape != self.buffer.shape:
                raise ValueError(f"peer {i} has shape {tuple(peer.shape)}, the root has {tuple(self.buffer.shape)}")

    @property
    def copies(self) -> list[Buffer]:
        """The root and every peer."""
        return [self.buffer, *self.peers]


def _check_uniform(buffers: Sequence[Buffer], what: str) -> None:
    dtypes = {b.dtype for b in buffers}
    if len(dtypes) > 1:
        raise ValueError(f"all {what} must share a dtype, got {sorted(map(str, dtypes))}")
    shapes = {tuple(b.shape) for b in buffers}
    if len(shapes) > 1:
        raise ValueError(f"all {what} must share a shape, got {sorted(shapes)}")
    for i, b in enumerate(buffers):
        if b.rank < 1 or not b.is_contiguous:
            raise ValueError(f"{what}[{i}] must be a contiguous buffer with a page dimension")


@dataclass
class KVCacheBuffer:
    """The KV buffers of one data-parallel replica, one per TP shard.

    Args:
        replicates_kv_across_tp: True when every shard holds the same bytes
            (MLA-style), False when shards split the KV heads.
        values: One page tensor per TP shard; dim 0 indexes pages.
        scales: Optional per-shard quantization scales, paged like `values`.
        num_null_pages: Trailing pages no request holds (the paged cache's
            null page): `total_num_pages` leaves them out.
    """

    replicates_kv_across_tp: bool
    values: list[Buffer]
    scales: list[Buffer] | None = None
    num_null_pages: int = 0
    graph_values: list[Buffer] = field(init=False, repr=False)
    """`values` as graphs take them (`contract.graph_dtype`): float8 codes
    viewed as uint8, anything else as it is."""

    def __post_init__(self) -> None:
        check_bool("replicates_kv_across_tp", self.replicates_kv_across_tp)
        _check_buffers("values", self.values)
        if self.scales is not None:
            _check_buffers("scales", self.scales)
        check_int("num_null_pages", self.num_null_pages, minimum=0)
        if not self.values:
            raise ValueError("values must hold at least one buffer")
        if not 0 <= self.num_null_pages < self.values[0].shape[0]:
            raise ValueError(
                f"num_null_pages={self.num_null_pages} must leave at least one of the "
                f"{self.values[0].shape[0]} pages to requests"
            )
        if self.replicates_kv_across_tp and len(self.values) < 2:
            raise ValueError(f"replicates_kv_across_tp=True needs at least 2 TP shards, got {len(self.values)}")
        _check_uniform(self.values, "values")
        self.graph_values = [graph_view(v) for v in self.values]
        if self.scales is None:
            return
        if len(self.scales) != len(self.values):
            raise ValueError(f"scales has {len(self.scales)} buffers, values has {len(self.values)}")
        _check_uniform(self.scales, "scales")
        if self.scales[0].shape[0] != self.values[0].shape[0]:
            raise ValueError(f"scales have {self.scales[0].shape[0]} pages, values have {self.values[0].shape[0]}")
        for i, (value, scale) in enumerate(zip(self.values, self.scales, strict=True)):
            if value.device != scale.device:
                raise ValueError(f"shard {i}: values on {value.device}, scales on {scale.device}")

    @classmethod
    def allocate(
        cls,
        params: KVCacheParams,
        total_num_pages: int,
        devices: Sequence[DeviceRef],
        *,
        null_page: bool = True,
        tokens_per_page: int | None = None,
    ) -> KVCacheBuffer:
        """Zero-filled page tensors, one per device in `devices`, with
        `total_num_pages` pages for requests plus the null page (if asked);
        for a quantized cache (`params.quantized`), zero-filled scales tensors
        beside them (`params.scales_shape`, same pages). `tokens_per_page`
        replaces `params.page_size` (a continuous cache's pages are its
        `max_seq_len` slots).

        Raises:
            TypeError, ValueError: A bad count or device, by name.
            ValueError: A device's tensors would not fit in its free memory
                (checked before anything is allocated).
            MemoryError: The allocation failed anyway; the message names the size.
        """
        if not isinstance(params, KVCacheParams):
            raise TypeError(f"params must be a mokv KVCacheParams, got {type(params).__name__}")
        check_int("total_num_pages", total_num_pages, minimum=1)
        num_null_pages = int(check_bool("null_page", null_page))
        num_pages = total_num_pages + num_null_pages
        tensors = [(params.block_shape(num_pages, tokens_per_page), params.dtype)]
        if params.kvcache_quant_config is not None:
            tensors.append((params.scales_shape(num_pages, tokens_per_page), params.kvcache_quant_config.scale_dtype))
        targets = [_device(i, ref) for i, ref in enumerate(devices)]
        described = " and ".join(f"{shape} {dtype.name}" for shape, dtype in tensors)
        what = f"total_num_pages={total_num_pages} ({described} per device)"
        sizes = [math.prod(shape) * dtype.size_in_bytes for shape, dtype in tensors]
        for device in set(targets):
            check_fits(what, sum(sizes) * targets.count(device), device)

        def zeros(shape: list[int], dtype: DType, nbytes: int) -> list[Buffer]:
            return [
                allocate(what, nbytes, device, lambda d=device: Buffer.zeros(shape, dtype, device=d))
                for device in targets
            ]

        values = zeros(*tensors[0], sizes[0])
        scales = zeros(*tensors[1], sizes[1]) if len(tensors) > 1 else None
        return cls(replicates_kv_across_tp=False, values=values, scales=scales, num_null_pages=num_null_pages)

    @property
    def all_buffers(self) -> list[Buffer]:
        """Every value buffer, then every scale buffer."""
        return [*self.values, *(self.scales or [])]

    @property
    def shard_scales(self) -> list[Buffer | None]:
        """Each TP shard's scales tensor, in `values` order: None for every
        shard of an unquantized cache."""
        return list(self.scales) if self.scales is not None else [None] * len(self.values)

    @property
    def num_physical_pages(self) -> int:
        """Pages in each buffer (values and scales agree), null pages included."""
        return self.values[0].shape[0]

    @property
    def total_num_pages(self) -> int:
        """Pages requests can hold: `num_physical_pages` less the null pages."""
        return self.num_physical_pages - self.num_null_pages

    def to_memory(self) -> list[KVCacheMemory]:
        """Offload-ready units: per kind (values, scales) and per TP group.

        Sharded buffers give one `KVCacheMemory` per shard; replicated shards
        give one `ReplicatedKVCacheMemory` whose peers are the other shards.
        """
        units: list[KVCacheMemory] = []
        for kind in (self.values, self.scales):
            if kind is None:
                continue
            pages = [_as_pages(b) for b in kind]
            if self.replicates_kv_across_tp:
                units.append(ReplicatedKVCacheMemory(pages[0], peers=pages[1:]))
            else:
                units.extend(KVCacheMemory(p) for p in pages)
        return units
