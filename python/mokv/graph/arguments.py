"""Checks on what the op wrappers are given, while the graph is built.

A wrong dtype, rank or head layout would otherwise surface at compile time as
a kernel instantiation error far from the call, or not at all (a float layer
index silently truncated). Each check raises `TypeError` or `ValueError`
naming the argument and what it got.
"""

from __future__ import annotations

from max.dtype import DType
from max.graph import StaticDim, TensorValue

from ..validation import check_finite, check_int
from .cache_values import CacheLayout


def num_layers(cache: CacheLayout) -> int | None:
    """The cache's layer count when the graph knows it statically."""
    blocks = getattr(cache, "blocks", None)
    if blocks is not None:
        dim = blocks.shape[2]
        return int(dim) if isinstance(dim, StaticDim) else None
    return getattr(getattr(cache, "params", None), "num_layers", None)


def check_index(name: str, value: object, bound: int | None) -> None:
    """A layer or K/V index: an `int` in `[0, bound)` or a uint32 scalar graph value."""
    if isinstance(value, TensorValue):
        if value.dtype != DType.uint32 or value.rank != 0:
            raise TypeError(f"{name} must be a uint32 scalar, got {value.dtype} of rank {value.rank}")
        return
    check_int(name, value, minimum=0, maximum=None if bound is None else bound - 1)


def check_scalar(name: str, value: object, dtype: DType, *, positive: bool = False) -> None:
    """A scalar operand: a finite number (an `int` >= 0 for uint32) or a graph scalar of `dtype`."""
    if isinstance(value, TensorValue):
        if value.dtype != dtype or value.rank != 0:
            raise TypeError(f"{name} must be a {dtype} scalar, got {value.dtype} of rank {value.rank}")
    elif dtype == DType.uint32:
        check_int(name, value, minimum=0, maximum=(1 << 32) - 1)
    else:
        check_finite(name, value, positive=positive)


def check_vector(name: str, value: object) -> None:
    """A uint32 `[n]` graph tensor (row offsets, batch rows, positions)."""
    if not isinstance(value, TensorValue):
        raise TypeError(f"{name} must be a graph TensorValue, got {type(value).__name__}")
    if value.dtype != DType.uint32 or value.rank != 1:
        raise TypeError(f"{name} must be uint32 of rank 1, got {value.dtype} with shape {list(value.shape)}")


MODEL_DTYPES = (DType.float32, DType.bfloat16)
"""What a quantized cache's keys, values, queries and gathered rows may be."""


def is_quantized(cache: CacheLayout) -> bool:
    """Whether the cache stores 8-bit codes with scales."""
    return bool(getattr(cache, "quantized", False))


def row_dtypes(cache: CacheLayout) -> tuple[DType, ...]:
    """The dtypes the cache's token rows may have in a graph: its own, or for
    a quantized cache the model dtypes it quantizes from."""
    return MODEL_DTYPES if is_quantized(cache) else (cache.row_type(0).dtype,)


def check_rows(name: str, value: object, cache: CacheLayout, *, head_multiple: bool = False) -> None:
    """Token rows `[n, heads, head_dim]` in a dtype the cache takes (`row_dtypes`):
    exactly the cache's KV heads, or with `head_multiple` a multiple of them
    (query heads)."""
    if not isinstance(value, TensorValue):
        raise TypeError(f"{name} must be a graph TensorValue, got {type(value).__name__}")
    row = cache.row_type(value.shape[0] if value.rank else 0)
    _, kv_heads, head_dim = row.shape
    dtypes = row_dtypes(cache)
    if value.dtype not in dtypes or value.rank != 3:
        allowed = " or ".join(str(d) for d in dtypes)
        raise TypeError(
            f"{name} must be {allowed} [tokens, heads, head_dim], got {value.dtype} with shape {list(value.shape)}"
        )
    heads, dim = value.shape[1], value.shape[2]
    if dim != head_dim:
        raise ValueError(f"{name} has head_dim {dim}, the cache has {head_dim}")
    if not head_multiple and heads != kv_heads:
        raise ValueError(f"{name} has {heads} heads, the cache has {kv_heads} KV heads")
    static = isinstance(heads, StaticDim) and isinstance(kv_heads, StaticDim)
    if head_multiple and static and int(heads) % int(kv_heads):
        raise ValueError(f"{name} has {heads} heads, not a multiple of the cache's {kv_heads} KV heads")


def check_store_kv(cache: CacheLayout, layer_idx: object, keys: object, values: object, offsets: object) -> None:
    """`store_kv`'s arguments."""
    check_index("layer_idx", layer_idx, num_layers(cache))
    check_rows("keys", keys, cache)
    check_rows("values", values, cache)
    if keys.dtype != values.dtype:  # type: ignore[union-attr]
        raise TypeError(f"keys are {keys.dtype} but values are {values.dtype}")  # type: ignore[union-attr]
    check_vector("input_row_offsets", offsets)


def check_gather_kv(
    cache: CacheLayout,
    layer_idx: object,
    kv_idx: object,
    batch_rows: object,
    positions: object,
    dtype: object = None,
) -> None:
    """`gather_kv`'s (and `gather_kv_codes`') arguments; `dtype` is the rows' dtype, if given."""
    if dtype is not None and dtype not in row_dtypes(cache):
        allowed = " or ".join(str(d) for d in row_dtypes(cache))
        raise TypeError(f"dtype must be {allowed} for this cache, got {dtype}")
    check_index("layer_idx", layer_idx, num_layers(cache))
    check_index("kv_idx", kv_idx, 2)
    check_vector("batch_rows", batch_rows)
    check_vector("positions", positions)


HEAD_DIM_MULTIPLE = 16
"""What `attention` needs head_dim (and a quantized cache's granularity) to be
a multiple of on every machine: the widest CPU float32 vector."""


def check_head_dim(cache: CacheLayout) -> None:
    """The cache's head_dim and scale granularity, where the graph knows them,
    are multiples of `HEAD_DIM_MULTIPLE` (the kernel checks them again at run
    time when they are symbolic)."""
    head_dim = cache.row_type(0).shape[2]
    if not isinstance(head_dim, StaticDim):
        return
    if int(head_dim) % HEAD_DIM_MULTIPLE:
        raise ValueError(f"attention needs head_dim to be a multiple of {HEAD_DIM_MULTIPLE}, the cache has {head_dim}")
    scales = getattr(cache, "scales", None)
    granules = None if scales is None else scales.shape[5]
    if isinstance(granules, StaticDim) and (int(head_dim) // int(granules)) % HEAD_DIM_MULTIPLE:
        raise ValueError(
            f"attention needs the quantization granularity to be a multiple of {HEAD_DIM_MULTIPLE},"
            f" the cache has {int(head_dim) // int(granules)} (head_dim {head_dim} over {granules} scales)"
        )


def check_attention(
    cache: CacheLayout, layer_idx: object, q: object, offsets: object, scale: object, sliding_window: object
) -> None:
    """`attention`'s arguments."""
    check_index("layer_idx", layer_idx, num_layers(cache))
    check_rows("q", q, cache, head_multiple=True)
    check_vector("input_row_offsets", offsets)
    check_scalar("scale", scale, DType.float32, positive=True)
    check_scalar("sliding_window", sliding_window, DType.uint32)
    check_head_dim(cache)
