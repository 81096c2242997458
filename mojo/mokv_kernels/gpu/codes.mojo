"""A cache's stored elements as float32 on a GPU: plain values, or 8-bit
codes times their scale. A quantized cache (`..kv_quantization`) holds `float8_e4m3fn`
or `int8` codes beside float32 scales, one per granule of `granularity`
elements of one head of `tokens_per_scale` tokens; kernels widen the codes
in registers as they read them, and take each granule's scale once."""

from std.memory import bitcast

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
        return widened(stored) * (scale * widened_unit[dtype]())
    else:
        return stored.cast[DType.float32]()


@always_inline
def codes_as_float16[
    dtype: DType, width: Int
](codes: SIMD[dtype, width]) -> SIMD[DType.float16, width]:
    """8-bit codes' values as float16, exactly (every float8_e4m3fn value,
    448 the largest, and every int8 has one), for the kernels that multiply
    codes as they are and apply each key's one scale after the products
    (`..attention.mma`). A pair of float8 codes is one conversion
    instruction from sm_89 on (`cvt.rn.f16x2.e4m3x2`, what the cast
    emits); an int8 code plus 128 becomes the low byte of 1024's mantissa,
    and 1152 comes off, two codes per instruction and no integer-to-float
    conversion. The float8 NaN codes stay NaN: the store never writes them."""
    comptime assert is_quantized[dtype](), "8-bit codes"
    comptime if dtype == DType.float8_e4m3fn:
        return codes.cast[DType.float16]()
    else:
        var biased = bitcast[DType.uint8, width](codes) ^ 0x80
        var above = bitcast[DType.float16, width](biased.interleave(SIMD[DType.uint8, width](0x64)))
        return above - 1152.0


@always_inline
def widened[dtype: DType, width: Int](codes: SIMD[dtype, width]) -> SIMD[DType.float32, width]:
    """8-bit codes as float32 in units of `widened_unit`, exactly: what
    `as_values` multiplies by the scale."""
    comptime if dtype == DType.float8_e4m3fn and width % 2 == 0:
        return e4m3_as_float16[width](rebind[SIMD[DType.float8_e4m3fn, width]](codes)).cast[
            DType.float32
        ]()
    elif dtype == DType.int8:
        return int8_as_float32[width](rebind[SIMD[DType.int8, width]](codes))
    else:
        return widen[dtype, width](codes)


@always_inline
def head_scales[cache_t: KVCacheT](cache: cache_t, row: Int, pos: Int, head: Int) -> ScalePtr:
    """The scales of head `head` of token `pos` of batch row `row` (one per
    granule); meaningless for an unquantized cache."""
    return head_scales_in_page(cache, cache.page_index(row, pos), pos, head)


@always_inline
def head_scales_in_page[
    cache_t: KVCacheT
](cache: cache_t, page: Int, pos: Int, head: Int) -> ScalePtr:
    """`head_scales` of token `pos` once its page is known."""
    return cache.scale_row_in_page(page, pos).unsafe_offset(head * cache.scales().granules)


@always_inline
def e4m3_as_float16[
    width: Int
](codes: SIMD[DType.float8_e4m3fn, width]) -> SIMD[DType.float16, width]:
    """`widen`'s float16 of each code (its value times 2^-8: the code's
    bits below a float16's sign), built in 32-bit words of two codes: a
    GPU has no 16-bit vector shifts, so `widen`'s shift and mask per code
    cost three instructions each, these two per pair (after a byte
    permute). `width` even."""
    comptime assert width % 2 == 0, "whole pairs of codes"
    # Each code to the top byte of a 16-bit half: bytes 0, c0, 0, c1, ...
    var spaced = SIMD[DType.uint8, width](0).interleave(bitcast[DType.uint8, width](codes))
    var pairs = bitcast[DType.uint32, width // 2](spaced)
    # s eeee mmm 0000 0000 -> s 0 eeee mmm 000 0000 in each half.
    return bitcast[DType.float16, width]((pairs & 0x80008000) | ((pairs >> 1) & 0x3F803F80))


@always_inline
def int8_as_float32[width: Int](codes: SIMD[DType.int8, width]) -> SIMD[DType.float32, width]:
    """Each code as float32, exactly, without an integer-to-float
    conversion (an eighth of float32 additions' rate on sm_90): the code
    plus 128 as the low byte of 2^23's mantissa, then 2^23 + 128 taken
    off."""
    var biased = bitcast[DType.uint8, width](codes) ^ 0x80
    var above = bitcast[DType.float32, width](biased.cast[DType.uint32]() | 0x4B000000)
    return above - 8388736.0
