"""A cache's stored elements as float32 on a GPU: plain values, or 8-bit
codes times their scale. A quantized cache (`..kv_quantization`) holds `float8_e4m3fn`
or `int8` codes beside float32 scales, one per granule of `granularity`
elements of one head of `tokens_per_scale` tokens; kernels widen the codes
in registers as they read them, and take each granule's scale once."""

from ..cache.traits import KVCacheT
from ..pointers import ScalePtr
from ..kv_quantization import is_quantized, widen, widened_unit


@always_inline
def as_values[
    dtype: DType, width: Int
](stored: SIMD[dtype, width], scale: Float32) -> SIMD[DType.float32, width]:
    """`width` stored elements as float32: codes widened times `scale` (their
    granule's), or an unquantized cache's values as they are (`scale`
    unused). The elements must share one granule."""
    comptime if is_quantized[dtype]():
        return widen[dtype, width](stored) * (scale * widened_unit[dtype]())
    else:
        return stored.cast[DType.float32]()


@always_inline
def head_scales[cache_t: KVCacheT](cache: cache_t, row: Int, pos: Int, head: Int) -> ScalePtr:
    """The scales of head `head` of token `pos` of batch row `row` (one per
    granule); meaningless for an unquantized cache."""
    return cache.scale_row(row, pos).unsafe_offset(head * cache.scales().granules)
