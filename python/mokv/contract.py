"""The graph contract: what a cache hands a model graph, defined once.

`contract.md` beside this module is the one-page description. Everything that
builds or reads cache inputs derives from the tables here: the managers'
runtime inputs (`PagedCacheInputs` / `ContinuousCacheInputs` of `Buffer`s),
the graph input types (the same classes holding `TensorType`s, from
`paged_input_types` / `cache_input_types`), the graph values the op wrappers
take (`mokv.graph.PagedCacheValues` subclasses them) and the Mojo ops, whose
operands follow `PAGED_INPUTS` / `CONTINUOUS_INPUTS` in order.

Page counts: `total_num_pages` is always the pages requests can hold. A paged
block tensor has one more, the null page, at index `total_num_pages`
(`NULL_PAGE_DOC`); the tensor's page dimension is therefore called
`num_physical_pages` (= `total_num_pages + 1`).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Generic, Protocol, TypeVar

from max.dtype import DType
from max.graph import BufferType, DeviceRef, TensorType

from .params import AnyKVCacheParams, MultiKVCacheParams
from .validation import check_int

T = TypeVar("T")
"""What a field holds: a runtime `Buffer`, a graph `TensorType`, or a graph value."""

NULL_PAGE_DOC = (
    "Unused lookup-table entries hold the null page id, total_num_pages: a real page of the block "
    "tensor that no request owns, so a kernel reading past a request's pages stays in bounds."
)


@dataclass(frozen=True)
class InputSpec:
    """One graph input of a cache, per device.

    `dims` entries are ints, names of cache parameters (`num_layers`,
    `n_kv_heads_per_device`, `head_dim`) or symbolic dimension names; `dtype`
    None means the cache's own dtype. `on_host` inputs always live on the CPU
    (they size work on the host); the others on the cache's device.
    `mutable` inputs are `BufferType`s that ops write in place.
    """

    name: str
    dtype: DType | None
    dims: tuple[int | str, ...]
    meaning: str
    on_host: bool = False
    mutable: bool = False


_PARAM_DIMS = ("num_layers", "n_kv_heads_per_device", "head_dim")


def _blocks(slots: str, slot_len: str, slot_meaning: str) -> InputSpec:
    return InputSpec(
        "blocks",
        None,
        (slots, 2, "num_layers", slot_len, "n_kv_heads_per_device", "head_dim"),
        f"K (index 0 of dim 1) and V (1) of every {slot_meaning}",
        mutable=True,
    )


_CACHE_LENGTHS = InputSpec(
    "cache_lengths", DType.uint32, ("batch_size",), "tokens of each request already in the cache, excluding this step's"
)

PAGED_INPUTS = (
    _blocks("num_physical_pages", "page_size", "page; page total_num_pages is the null page"),
    _CACHE_LENGTHS,
    InputSpec(
        "lookup_table",
        DType.uint32,
        ("batch_size", "max_pages_per_seq"),
        "row b: request b's page ids in token order, padded with the null page",
    ),
    InputSpec(
        "max_lengths",
        DType.uint32,
        ("num_steps", 2),
        "row i: (most new tokens of a request at step i, longest context at step i including them); "
        "read by attention to check the batch and plan its work without scanning the rows",
        on_host=True,
    ),
)
"""A paged cache's inputs per device, in graph order."""

CONTINUOUS_INPUTS = (
    _blocks("num_slots", "max_seq_len", "sequence slot"),
    _CACHE_LENGTHS,
    InputSpec("lookup_table", DType.uint32, ("batch_size",), "row b: request b's slot"),
    InputSpec(
        "is_cache_empty",
        DType.bool,
        (),
        "true only when every cache length is 0 (a batch of fresh prompts); read by attention",
        on_host=True,
    ),
)
"""A continuous-batching cache's inputs per device, in graph order."""


class _PerDevice(Generic[T]):
    """Shared by the per-device input records: fields in contract order."""

    def flatten(self) -> list[T]:
        """The fields in graph-input order."""
        return [getattr(self, f.name) for f in fields(self)]  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[T]:
        return iter(self.flatten())


@dataclass(frozen=True)
class PagedCacheInputs(_PerDevice[T]):
    """One device's paged-cache inputs (`PAGED_INPUTS`): runtime `Buffer`s from
    the manager, or `TensorType`s from `paged_input_types`."""

    blocks: T
    cache_lengths: T
    lookup_table: T
    max_lengths: T


@dataclass(frozen=True)
class ContinuousCacheInputs(_PerDevice[T]):
    """One device's continuous-batching inputs (`CONTINUOUS_INPUTS`)."""

    blocks: T
    cache_lengths: T
    lookup_table: T
    is_cache_empty: T


@dataclass(frozen=True)
class KVCacheInputs(Generic[T]):
    """One cache's inputs for a step: `inputs[i]` is device i's (replica-major
    over `params.devices`). `flatten()` is the graph's argument order."""

    inputs: list[PagedCacheInputs[T] | ContinuousCacheInputs[T]]

    def flatten(self) -> list[T]:
        return [x for device in self.inputs for x in device.flatten()]


@dataclass(frozen=True)
class MultiKVCacheInputs(Generic[T]):
    """Several caches' inputs (see `MultiKVCacheParams`), children in
    declaration order; `flatten()` concatenates theirs."""

    children: Mapping[str, KVCacheInputs[T] | MultiKVCacheInputs[T]]

    def flatten(self) -> list[T]:
        return [x for child in self.children.values() for x in child.flatten()]


class CacheShape(Protocol):
    """What fixes a cache's graph types on one device (`KVCacheParams` has it)."""

    dtype: DType
    num_layers: int
    head_dim: int

    @property
    def n_kv_heads_per_device(self) -> int: ...


def _dim(dim: int | str, shape: CacheShape, named: Mapping[str, int | str]) -> int | str:
    """A spec dimension resolved: a cache parameter, a caller-given size, or the symbolic name."""
    if isinstance(dim, int):
        return dim
    if dim in _PARAM_DIMS:
        return getattr(shape, dim)
    return named.get(dim, dim)


def _types(
    specs: Sequence[InputSpec], shape: CacheShape, device: DeviceRef, named: Mapping[str, int | str]
) -> list[BufferType | TensorType]:
    for name, size in named.items():  # a fixed size (page_size, max_seq_len) or a symbol's name
        if not isinstance(size, str):
            check_int(name, size, minimum=1)
    if not isinstance(device, DeviceRef):
        raise TypeError(f"device must be a max.graph.DeviceRef, got {device!r}")
    out: list[BufferType | TensorType] = []
    for spec in specs:
        dims = [_dim(d, shape, named) for d in spec.dims]
        dtype = spec.dtype or shape.dtype
        where = DeviceRef.CPU() if spec.on_host else device
        out.append(BufferType(dtype, dims, where) if spec.mutable else TensorType(dtype, dims, where))
    return out


def paged_input_types(
    shape: CacheShape, page_size: int | str = "page_size", device: DeviceRef | None = None
) -> PagedCacheInputs[BufferType | TensorType]:
    """One device's paged-cache input types. `page_size` may stay symbolic:
    the kernels read it from the block tensor, so one compiled graph then
    serves every page size."""
    return PagedCacheInputs(*_types(PAGED_INPUTS, shape, device or DeviceRef.CPU(), {"page_size": page_size}))


def continuous_input_types(
    shape: CacheShape, max_seq_len: int | str = "max_seq_len", device: DeviceRef | None = None
) -> ContinuousCacheInputs[BufferType | TensorType]:
    """One device's continuous-batching input types (`max_seq_len` may stay
    symbolic, as `page_size` in `paged_input_types`)."""
    return ContinuousCacheInputs(
        *_types(CONTINUOUS_INPUTS, shape, device or DeviceRef.CPU(), {"max_seq_len": max_seq_len})
    )


def cache_input_types(
    params: AnyKVCacheParams, page_size: int | str = "page_size"
) -> KVCacheInputs[BufferType | TensorType] | MultiKVCacheInputs[BufferType | TensorType]:
    """The graph input types of a paged manager's `runtime_inputs`: every
    device of every replica, for every cache of a `MultiKVCacheParams`, in the
    same tree shape, so `.flatten()` gives `Graph(input_types=...)`. Heads are
    per device (`n_kv_heads_per_device`), as the buffers are allocated."""
    if isinstance(params, MultiKVCacheParams):
        return MultiKVCacheInputs(
            {name: cache_input_types(child, page_size) for name, child in params.children.items()}
        )
    return KVCacheInputs([paged_input_types(params, page_size, ref) for ref in params.devices])
