"""MAX's cache values as mokv's ops take them: the one place that maps them.

MAX 26.7's pipelines hand each attention layer one device's cache as
`max.nn.kv_cache.PagedCacheValues` (`KVCacheInputsPerDevice` of graph values).
Its block tensor is mokv's paged layout (`[pages, 2, layers, page_size,
kv_heads, head_dim]`, the null page last, unused lookup-table entries pointing
at it), so `mokv_cache_values` passes the component tensors through and builds
only what differs:

- `max_lengths` `[1, 2]` is MAX's `max_prompt_length` and `max_cache_length`
  side by side: both are host `[1]` uint32 tensors with exactly the meaning of
  mokv's row (most new tokens of a row; longest context including them).
- `page_stride` (int64 `[1]` on the host) is a run-time value in MAX's graphs,
  read off the allocation when the inputs are bound. mokv's kernels address
  packed pages only, so a step whose `page_stride` (or `scales_page_stride`) is
  not `PACKED_PAGE_STRIDE` (-1) fails before any of mokv's ops touches a page
  (the check is folded into `cache_lengths`, which they all read), with an
  error naming `page_stride`. A non-packed view is what MAX's own Jenga pool
  binds when cache groups of different page sizes share one slab: the bound
  buffer is then shorter than the span the stride reaches, so no graph op can
  re-address it; honouring it needs the stride inside the kernels' paged
  layout.
- An 8-bit cache: MAX's scale buffer (`kv_scales`, `[pages, 2, layers,
  page_size, kv_heads, head_dim // granularity]` float32) is mokv's scale
  layout with one scale per token (`tokens_per_scale` 1), a stored element
  times its scale being the cached value in both, so it passes through as
  `scales`. Other scale dtypes (MAX's float16 for int8, float8_e8m0fnu, NVFP4's
  float8_e4m3fn) are refused, as are scales paged apart from the values
  (a step whose `scales_lookup_table` differs from `lookup_table` fails naming
  it). float8 blocks must reach the graph as their uint8 bits
  (`mokv.params.graph_dtype`: MAX 26.7's CPU graphs take no float8 tensors).
- Per-layer buffers (`kv_blocks_per_layer`) are refused while the graph is
  built: mokv keeps every layer in one block tensor.

MAX's attention dispatch metadata is for MAX's own GPU kernels; mokv's
attention plans from `max_lengths` and ignores it.
"""

from __future__ import annotations

from max.dtype import DType
from max.graph import DeviceRef, StaticDim, TensorValue, ops
from max.nn.kv_cache import PagedCacheValues as MaxPagedCacheValues
from max.nn.kv_cache.cache_params import PACKED_PAGE_STRIDE

from ..graph import PagedCacheValues

_CODE_DTYPES = (DType.uint8, DType.int8)
"""How 8-bit blocks reach a graph: float8_e4m3fn codes as their uint8 bits, int8 as itself."""


def _refuse_unless_none(found: TensorValue, what: str) -> TensorValue:
    """`found` (a `[n, rank]` `ops.nonzero` result) checked at run time to have
    no rows, failing the step with `what` in the message otherwise; returns a
    `[1]` uint32 zero on the host that carries the check, for the caller to
    fold into a value every op reads (so the check runs before any of them and
    is never pruned)."""
    checked = ops.rebind(found, [0, found.shape[1]], message=what)
    return ops.reshape(ops.cast(ops.sum(ops.sum(checked, axis=1), axis=0), DType.uint32), [1])


def _packed_check(stride: TensorValue, name: str) -> TensorValue:
    not_packed = ops.not_equal(stride, ops.constant(PACKED_PAGE_STRIDE, DType.int64, DeviceRef.CPU()))
    return _refuse_unless_none(
        ops.nonzero(not_packed, f"{name}_not_packed"),
        f"{name} is not {PACKED_PAGE_STRIDE} (packed pages): mokv's kernels read packed pages only, "
        "so this cache's pages (a padded view of a shared slab) cannot be read through mokv's ops",
    )


def _same_table_check(scales_table: TensorValue, table: TensorValue) -> TensorValue:
    differs = ops.not_equal(ops.rebind(scales_table, table.shape), table)
    return _refuse_unless_none(
        ops.transfer_to(ops.nonzero(differs, "scale_pages_apart"), DeviceRef.CPU()),
        "scales_lookup_table differs from lookup_table: mokv pages the scales with the values",
    )


def _check_static_layout(values: MaxPagedCacheValues) -> None:
    """What the graph's types already tell: refused while the graph is built."""
    if values.kv_blocks_per_layer is not None or values.kv_scales_per_layer is not None:
        raise ValueError(
            "kv_blocks_per_layer is set (MAX's per_layer_buffers): mokv keeps every layer in one block tensor"
        )
    blocks_dtype = values.kv_blocks.dtype
    if values.kv_scales is None:
        if blocks_dtype in (DType.float8_e4m3fn, *_CODE_DTYPES):
            raise ValueError(f"kv_blocks are {blocks_dtype.name} but kv_scales is None: 8-bit blocks need scales")
        return
    if values.kv_scales.dtype != DType.float32:
        raise ValueError(f"kv_scales are {values.kv_scales.dtype.name}: mokv's kernels read float32 scales only")
    if blocks_dtype not in _CODE_DTYPES:
        raise ValueError(
            f"kv_blocks of a quantized cache must be uint8 (float8_e4m3fn bits) or int8 in the graph, got "
            f"{blocks_dtype.name} (declare float8 blocks as uint8: mokv.params.graph_dtype)"
        )
    token_rows, scale_rows = values.kv_blocks.shape[3], values.kv_scales.shape[3]
    if isinstance(token_rows, StaticDim) and isinstance(scale_rows, StaticDim) and token_rows != scale_rows:
        raise ValueError(
            f"kv_scales have {scale_rows} rows per page for {token_rows} tokens: MAX's layout has one per token"
        )


def mokv_cache_values(values: MaxPagedCacheValues) -> PagedCacheValues:
    """One device's MAX cache values as `mokv.graph.PagedCacheValues`, for
    `mokv.graph.store_kv` / `attention` (see the module docstring for what is
    mapped, checked at run time, or refused).

    Raises:
        ValueError: per-layer buffers, scales in a dtype other than float32,
            an 8-bit cache without scales or with blocks not declared as their
            8-bit codes; the message names the field.
    """
    _check_static_layout(values)
    checks = _packed_check(values.page_stride, "page_stride")
    if values.kv_scales is not None:
        assert values.scales_page_stride is not None and values.scales_lookup_table is not None
        checks = checks + _packed_check(values.scales_page_stride, "scales_page_stride")
        checks = checks + _same_table_check(values.scales_lookup_table, values.lookup_table)
    return PagedCacheValues(
        blocks=values.kv_blocks,
        cache_lengths=values.cache_lengths + checks.to(values.cache_lengths.device),
        lookup_table=values.lookup_table,
        max_lengths=ops.reshape(ops.concat([values.max_prompt_length, values.max_cache_length]), [1, 2]),
        scales=values.kv_scales,
    )
