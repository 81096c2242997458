"""Wrappers that put mokv's Mojo ops into a graph: the one place that knows op names."""

from __future__ import annotations

from max.dtype import DType
from max.graph import DeviceRef, TensorValue, ops

from .cache_values import CacheLayout


def _scalar(value: int | TensorValue) -> TensorValue:
    """A uint32 scalar operand: a Python int becomes a graph constant; a graph
    value (a runtime layer index, say) passes through."""
    if isinstance(value, TensorValue):
        return value
    return ops.constant(value, DType.uint32, device=DeviceRef.CPU())


def store_kv(
    cache: CacheLayout,
    layer_idx: int | TensorValue,
    keys: TensorValue,
    values: TensorValue,
    input_row_offsets: TensorValue,
) -> None:
    """Writes a ragged batch's new keys and values `[total_new_tokens, kv_heads,
    head_dim]` of layer `layer_idx` at positions `cache_lengths[b] ..` of each
    sequence b, in place. `input_row_offsets` `[batch + 1]` uint32 delimits the
    sequences."""
    ops.inplace_custom(
        f"mokv.store_kv.{cache.layout}",
        device=cache.device,
        values=[*cache.operands(), keys, values, input_row_offsets, _scalar(layer_idx)],
    )


def gather_kv(
    cache: CacheLayout,
    layer_idx: int | TensorValue,
    kv_idx: int | TensorValue,
    batch_rows: TensorValue,
    positions: TensorValue,
) -> TensorValue:
    """Reads token `positions[i]` of batch row `batch_rows[i]` (both uint32
    `[n]`) from layer `layer_idx`'s keys (`kv_idx` 0) or values (1) as a dense
    `[n, kv_heads, head_dim]` tensor."""
    (rows,) = ops.inplace_custom(
        f"mokv.gather.{cache.layout}",
        device=cache.device,
        values=[*cache.operands(), batch_rows, positions, _scalar(layer_idx), _scalar(kv_idx)],
        out_types=[cache.row_type(positions.shape[0])],
    )
    return rows.tensor
