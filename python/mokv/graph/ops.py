"""Wrappers that put mokv's Mojo ops into a graph: the one place that knows op names.

Each operation is one Mojo op for the component tensors of either layout
(`mokv.store_kv`, `mokv.gather`, `mokv.attention`): the op tells a paged cache
from a continuous-batching one at compile time by the rank of its lookup table.
A quantized cache (8-bit codes with float32 scales) has its own variant of
each, taking the scales after `blocks` (`mokv.<operation>.quantized`), and
keys, values, queries and gathered rows in the model's dtype (float32 or
bfloat16). The opaque continuous-batching collection, a single operand, has its
own variant of each (`mokv.<operation>.continuous_collection`).

Each wrapper checks its arguments first (`mokv.graph.arguments`): a wrong
dtype, rank, head layout or index raises `TypeError` / `ValueError` naming it
while the graph is built, not as a kernel error at compile time.
"""

from __future__ import annotations

from max.dtype import DType
from max.graph import DeviceRef, TensorType, TensorValue, ops

from .arguments import check_attention, check_gather_kv, check_store_kv, is_quantized
from .cache_values import CacheLayout
from .continuous_collection import ContinuousBatchingKVCacheCollection


def _scalar(value: float | TensorValue, dtype: DType = DType.uint32) -> TensorValue:
    """A scalar operand (uint32 unless told): a Python number becomes a graph
    constant; a graph value (a runtime layer index, say) passes through."""
    if isinstance(value, TensorValue):
        return value
    return ops.constant(value, dtype, device=DeviceRef.CPU())


def _op_name(operation: str, cache: CacheLayout) -> str:
    if isinstance(cache, ContinuousBatchingKVCacheCollection):
        return f"mokv.{operation}.continuous_collection"
    if is_quantized(cache):
        return f"mokv.{operation}.quantized"
    return f"mokv.{operation}"


def store_kv(
    cache: CacheLayout,
    layer_idx: int | TensorValue,
    keys: TensorValue,
    values: TensorValue,
    input_row_offsets: TensorValue,
) -> None:
    """Writes a ragged batch's new keys and values `[total_new_tokens, kv_heads,
    head_dim]` of layer `layer_idx` at positions `cache_lengths[b] ..` of each
    sequence b, in place (into a quantized cache: quantized, with their
    scales). `input_row_offsets` `[batch + 1]` uint32 delimits the
    sequences."""
    check_store_kv(cache, layer_idx, keys, values, input_row_offsets)
    ops.inplace_custom(
        _op_name("store_kv", cache),
        device=cache.device,
        values=[*cache.operands(), keys, values, input_row_offsets, _scalar(layer_idx)],
    )


def gather_kv(
    cache: CacheLayout,
    layer_idx: int | TensorValue,
    kv_idx: int | TensorValue,
    batch_rows: TensorValue,
    positions: TensorValue,
    dtype: DType | None = None,
) -> TensorValue:
    """Reads token `positions[i]` of batch row `batch_rows[i]` (both uint32
    `[n]`) from layer `layer_idx`'s keys (`kv_idx` 0) or values (1) as a dense
    `[n, kv_heads, head_dim]` tensor: in the cache's dtype, or from a
    quantized cache dequantized into `dtype` (float32 unless told)."""
    check_gather_kv(cache, layer_idx, kv_idx, batch_rows, positions, dtype)
    row = cache.row_type(positions.shape[0])
    if is_quantized(cache):
        row = TensorType(dtype or DType.float32, row.shape, row.device)
    (rows,) = ops.inplace_custom(
        _op_name("gather", cache),
        device=cache.device,
        values=[*cache.operands(), batch_rows, positions, _scalar(layer_idx), _scalar(kv_idx)],
        out_types=[row],
    )
    return rows.tensor


def gather_kv_codes(
    cache: CacheLayout,
    layer_idx: int | TensorValue,
    kv_idx: int | TensorValue,
    batch_rows: TensorValue,
    positions: TensorValue,
) -> tuple[TensorValue, TensorValue]:
    """A quantized cache's rows as stored, as `gather_kv` finds them: the codes
    `[n, kv_heads, head_dim]` (in the blocks' graph dtype: float8 as uint8
    bits, int8) and their float32 scales `[n, kv_heads, granules]`."""
    if not is_quantized(cache):
        raise TypeError("gather_kv_codes reads a quantized cache; this one stores plain values (use gather_kv)")
    check_gather_kv(cache, layer_idx, kv_idx, batch_rows, positions)
    n = positions.shape[0]
    granules = cache.scales.shape[5]  # type: ignore[attr-defined]
    codes, scales = ops.inplace_custom(
        "mokv.gather.codes",
        device=cache.device,
        values=[*cache.operands(), batch_rows, positions, _scalar(layer_idx), _scalar(kv_idx)],
        out_types=[
            cache.row_type(n),
            TensorType(DType.float32, [n, cache.row_type(n).shape[1], granules], cache.device),
        ],
    )
    return codes.tensor, scales.tensor


def attention(
    cache: CacheLayout,
    layer_idx: int | TensorValue,
    q: TensorValue,
    input_row_offsets: TensorValue,
    scale: float | TensorValue,
    sliding_window: int | TensorValue = 0,
) -> TensorValue:
    """Flash attention of a ragged batch's queries over layer `layer_idx` of the cache.

    The cache's head_dim (and a quantized cache's granularity) must be a
    multiple of 16 (`HEAD_DIM_MULTIPLE`), on every machine.

    `q` `[total_new_tokens, n_q_heads, head_dim]` has the cache's dtype (for a
    quantized cache: float32 or bfloat16, its codes widened and scaled as they
    are read), with
    `n_q_heads` a multiple of the cache's KV heads (query head h reads KV head
    `h // (n_q_heads // n_kv_heads)`); `input_row_offsets` uint32 `[batch + 1]`
    delimits the sequences. New token i of sequence b sits at position
    `cache_lengths[b] + i`, its key and value already stored (`store_kv`), and
    attends to positions `0 ..= cache_lengths[b] + i`, or with `sliding_window`
    W > 0 to the last W of them. `scale` multiplies the scores (a float32 scalar,
    typically `1 / sqrt(head_dim)`); `sliding_window` is a uint32 scalar, 0 for
    none. Returns `[total_new_tokens, n_q_heads, head_dim]` in q's dtype,
    computed in float32.

    The op also reads the cache's host-side summary of the batch
    (`cache.dispatch_operand()`: `max_lengths` or `is_cache_empty`) and raises
    before its first write, naming the row, if a row has more new tokens than
    `max_lengths[0, 0]`, a longer context than `max_lengths[0, 1]`, or a
    nonzero cache length while `is_cache_empty` is true.
    """
    check_attention(cache, layer_idx, q, input_row_offsets, scale, sliding_window)
    summary = cache.dispatch_operand()
    (out,) = ops.inplace_custom(
        _op_name("attention", cache),
        device=cache.device,
        values=[
            *cache.operands(),
            *([] if summary is None else [summary]),
            q,
            input_row_offsets,
            _scalar(layer_idx),
            _scalar(scale, DType.float32),
            _scalar(sliding_window),
        ],
        out_types=[TensorType(q.dtype, q.shape, cache.device)],
    )
    return out.tensor
