"""The graph contract: what a cache hands a model graph, defined once.

`contract.md` beside this module is the one-page description. Everything that
builds or reads cache inputs derives from the tables here: the managers'
runtime inputs (`PagedCacheInputs` / `ContinuousCacheInputs` of `Buffer`s),
the graph input types (the same classes holding `TensorType`s, from
`paged_input_types` / `cache_input_types`), the graph values the op wrappers
take (`mokv.graph.PagedCacheValues` subclasses them) and the Mojo ops, whose
operands follow `PAGED_INPUTS` / `CONTINUOUS_INPUTS` in order.

A quantized cache (`KVCacheParams.kvcache_quant_config` set) has one more
input per device after the others, `scales` (the specs' last entry, marked
`quantized_only`), a float32 tensor paged like `blocks`. The records' `scales`
field is None for an unquantized cache and `flatten()` leaves it out, so
unquantized graphs keep four inputs per device.

Page counts: `total_num_pages` is always the pages requests can hold. A paged
page tensor (`blocks`) has one more, the null page, at index `total_num_pages`
(`NULL_PAGE_DOC`); the tensor's page dimension is therefore called
`num_physical_pages` (= `total_num_pages + 1`).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Generic, Protocol, TypeVar

from max.dtype import DType
from max.graph import BufferType, DeviceRef, TensorType

from .params import AnyKVCacheParams, KVCacheQuantConfig, MultiKVCacheParams, graph_dtype
from .validation import check_int

T = TypeVar("T")
"""What a field holds: a runtime `Buffer`, a graph `TensorType`, or a graph value."""

NULL_PAGE_DOC = (
    "Unused lookup-table entries hold the null page id, total_num_pages: a real page of the page "
    "tensor that no request owns, so a kernel reading past a request's pages stays in bounds."
)


@dataclass(frozen=True)
class InputSpec:
    """One graph input of a cache, per device.

    `dims` entries are ints, names of cache parameters (`num_layers`,
    `n_kv_heads_per_device`, `head_dim`), names of sizes the caller or the
    quant config fixes (`page_size`, `scale_rows`, `scale_cols`, ...) or
    symbolic dimension names; `dtype` None means the cache's own, as
    `graph_dtype` carries it (float8 as uint8). `on_host` inputs always live
    on the CPU (they size work on the host); the others on the cache's device.
    `mutable` inputs are `BufferType`s that ops write in place.
    `quantized_only` inputs exist only for a quantized cache.
    """

    name: str
    dtype: DType | None
    dims: tuple[int | str, ...]
    meaning: str
    on_host: bool = False
    mutable: bool = False
    quantized_only: bool = False


_PARAM_DIMS = ("num_layers", "n_kv_heads_per_device", "head_dim")


def _blocks(rows: str, row_len: str, row_meaning: str) -> InputSpec:
    """The `blocks` input (MAX's name): the tensor of pages (or continuous slots)."""
    return InputSpec(
        "blocks",
        None,
        (rows, 2, "num_layers", row_len, "n_kv_heads_per_device", "head_dim"),
        f"K (index 0 of dim 1) and V (1) of every {row_meaning}",
        mutable=True,
    )


def _scales(rows: str) -> InputSpec:
    return InputSpec(
        "scales",
        DType.float32,
        (rows, 2, "num_layers", "scale_rows", "n_kv_heads_per_device", "scale_cols"),
        "quantized caches only: the float32 scale of each block of tokens_per_scale tokens x "
        "granularity head_dim elements, paged like blocks (row r: tokens r * tokens_per_scale ..); "
        "a stored value times its scale is the cached key or value",
        mutable=True,
        quantized_only=True,
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
    _scales("num_physical_pages"),
)
"""A paged cache's inputs per device, in graph order (`scales` only when quantized)."""

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
    _scales("num_slots"),
)
"""A continuous-batching cache's inputs per device, in graph order (`scales` only when quantized)."""


class _PerDevice(Generic[T]):
    """Shared by the per-device input records: fields in contract order."""

    def flatten(self) -> list[T]:
        """The fields in graph-input order; `scales` only when set (a quantized cache)."""
        values = [getattr(self, f.name) for f in fields(self)]  # type: ignore[arg-type]
        return values if values[-1] is not None else values[:-1]

    def __iter__(self) -> Iterator[T]:
        return iter(self.flatten())


@dataclass(frozen=True)
class PagedCacheInputs(_PerDevice[T]):
    """One device's paged-cache inputs (`PAGED_INPUTS`): runtime `Buffer`s from
    the manager, or `TensorType`s from `paged_input_types`. The field names
    are MAX's (API)."""

    blocks: T
    """The page tensor: K and V of every page, the null page last."""
    cache_lengths: T
    """Per request, its tokens already in the cache (excluding this step's)."""
    lookup_table: T
    """Per request, its page ids in token order, padded with the null page."""
    max_lengths: T
    """Per step, (most new tokens of a request, longest context), on the host."""
    scales: T | None = None
    """A quantized cache's scales, paged like `blocks`; None otherwise."""


@dataclass(frozen=True)
class ContinuousCacheInputs(_PerDevice[T]):
    """One device's continuous-batching inputs (`CONTINUOUS_INPUTS`); the
    field names are MAX's (API)."""

    blocks: T
    """K and V of every sequence slot."""
    cache_lengths: T
    """Per request, its tokens already in the cache (excluding this step's)."""
    lookup_table: T
    """Per request, its slot."""
    is_cache_empty: T
    """Whether every cache length is 0, on the host."""
    scales: T | None = None
    """A quantized cache's scales, one row of them per slot; None otherwise."""


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
    """What fixes a cache's graph types on one device (`KVCacheParams` has it).

    A shape may also carry `kvcache_quant_config` (a `KVCacheQuantConfig`,
    as `KVCacheParams` does); one without that attribute, or with None, is an
    unquantized cache.
    """

    dtype: DType
    num_layers: int
    head_dim: int

    @property
    def n_kv_heads_per_device(self) -> int: ...


def quant_config_of(shape: CacheShape) -> KVCacheQuantConfig | None:
    """The shape's `kvcache_quant_config`; None (unquantized) when it has none."""
    return getattr(shape, "kvcache_quant_config", None)


def _scale_dims(config: KVCacheQuantConfig, shape: CacheShape, tokens_per_page: int | str) -> dict[str, int | str]:
    """`scale_rows` (tokens per page or slot / tokens_per_scale) and `scale_cols`
    (head_dim / granularity), ints where the sizes are known, else symbolic."""
    granularity = config.quantization_granularity
    if granularity is None:  # one scale per head, whatever head_dim is
        cols: int | str = 1
    else:
        cols = shape.head_dim // granularity if isinstance(shape.head_dim, int) else "scale_cols"
    if not isinstance(tokens_per_page, int):
        return {"scale_rows": "scale_rows", "scale_cols": cols}
    if tokens_per_page % config.tokens_per_scale:
        raise ValueError(
            f"kvcache_quant_config.tokens_per_scale={config.tokens_per_scale} must divide the "
            f"{tokens_per_page} tokens of a page"
        )
    return {"scale_rows": tokens_per_page // config.tokens_per_scale, "scale_cols": cols}


def _dim(dim: int | str, shape: CacheShape, named: Mapping[str, int | str]) -> int | str:
    """A spec dimension resolved: a cache parameter, a caller-given size, or the symbolic name."""
    if isinstance(dim, int):
        return dim
    if dim in _PARAM_DIMS:
        return getattr(shape, dim)
    return named.get(dim, dim)


def _types(
    specs: Sequence[InputSpec],
    shape: CacheShape,
    device: DeviceRef,
    page_len: tuple[str, int | str],
) -> list[BufferType | TensorType]:
    """The specs' types on `device` (the `quantized_only` ones only for a
    quantized `shape`). `page_len` names the tokens-per-page (or per-slot)
    dimension and gives its size (an int, or the symbol to use)."""
    name, size = page_len
    if not isinstance(size, str):  # a fixed size (page_size, max_seq_len) or a symbol's name
        check_int(name, size, minimum=1)
    if not isinstance(device, DeviceRef):
        raise TypeError(f"device must be a max.graph.DeviceRef, got {device!r}")
    named: dict[str, int | str] = {name: size}
    config = quant_config_of(shape)
    if config is None:
        specs = [spec for spec in specs if not spec.quantized_only]
    else:
        named.update(_scale_dims(config, shape, size))
    out: list[BufferType | TensorType] = []
    for spec in specs:
        dims = [_dim(d, shape, named) for d in spec.dims]
        dtype = spec.dtype or graph_dtype(shape.dtype)
        where = DeviceRef.CPU() if spec.on_host else device
        out.append(BufferType(dtype, dims, where) if spec.mutable else TensorType(dtype, dims, where))
    return out


def paged_input_types(
    shape: CacheShape, page_size: int | str = "page_size", device: DeviceRef | None = None
) -> PagedCacheInputs[BufferType | TensorType]:
    """One device's paged-cache input types (with `scales` for a quantized
    cache). `page_size` may stay symbolic: the kernels read it from the page
    tensor, so one compiled graph then serves every page size (the scales'
    rows are then the symbol `scale_rows`)."""
    return PagedCacheInputs(*_types(PAGED_INPUTS, shape, device or DeviceRef.CPU(), ("page_size", page_size)))


def continuous_input_types(
    shape: CacheShape, max_seq_len: int | str = "max_seq_len", device: DeviceRef | None = None
) -> ContinuousCacheInputs[BufferType | TensorType]:
    """One device's continuous-batching input types (`max_seq_len` may stay
    symbolic, as `page_size` in `paged_input_types`)."""
    return ContinuousCacheInputs(
        *_types(CONTINUOUS_INPUTS, shape, device or DeviceRef.CPU(), ("max_seq_len", max_seq_len))
    )


def cache_input_types(
    params: AnyKVCacheParams, page_size: int | str = "page_size"
) -> KVCacheInputs[BufferType | TensorType] | MultiKVCacheInputs[BufferType | TensorType]:
    """The graph input types of a paged manager's `runtime_inputs`: every
    device of every replica, for every cache of a `MultiKVCacheParams`, in the
    same tree shape, so `.flatten()` gives `Graph(input_types=...)`. Heads are
    per device (`n_kv_heads_per_device`), as the buffers are allocated; a
    quantized cache's devices each get their `scales`."""
    if isinstance(params, MultiKVCacheParams):
        return MultiKVCacheInputs(
            {name: cache_input_types(child, page_size) for name, child in params.children.items()}
        )
    return KVCacheInputs([paged_input_types(params, page_size, ref) for ref in params.devices])
