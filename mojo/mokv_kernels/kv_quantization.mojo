"""8-bit KV storage: what a stored element means, and how a row is quantized.

A quantized cache stores `float8_e4m3fn` or `int8` codes beside float32
scales: element x is held as code q with x ~ q * scale, one scale per granule
(`granularity` consecutive elements of one head of `tokens_per_scale`
consecutive tokens). The scale of a granule is its largest finite magnitude
over the code's range (`code_max`), so the largest element maps to the
largest code; larger magnitudes (infinities) saturate and NaN stores as 0.

Reading widens codes to float32 in registers (`widen`). On a CPU without
float8 instructions (AVX2) the fastest conversion moves the code's bits into
a float16 (its exponent and mantissa fields line up, subnormals included) and
widens that with the hardware's half-precision conversion: as fast as
widening int8, and faster than the standard library's float8 cast or a
256-entry lookup table (`tools/fp8_conversion_bench.mojo` times them).
That float16 is the code's value times 2^-8, so a float8 scale is applied
times 2^8 (`widened_unit`).
"""

from std.memory import bitcast

from .cache.traits import KVCacheT
from .pointers import CachePtr, F32Ptr


def is_quantized[dtype: DType]() -> Bool:
    """Whether a page tensor of `dtype` holds codes (with scales) rather
    than values."""
    return dtype == DType.float8_e4m3fn or dtype == DType.int8


def codes_in[graph_dtype: DType]() -> DType:
    """The codes that a quantized cache's pages of `graph_dtype` hold:
    float8 codes travel as their uint8 bits (MAX's CPU graphs take no float8
    tensors), int8 codes as themselves."""
    comptime assert (
        graph_dtype == DType.uint8 or graph_dtype == DType.int8
    ), "a quantized cache's pages are uint8 (float8_e4m3fn bits) or int8"
    return DType.float8_e4m3fn if graph_dtype == DType.uint8 else DType.int8


def code_max[dtype: DType]() -> Float32:
    """The largest magnitude a code of `dtype` holds."""
    comptime assert is_quantized[dtype](), "only float8_e4m3fn and int8 codes have a range"
    comptime if dtype == DType.float8_e4m3fn:
        return 448.0
    else:
        return 127.0


def widened_unit[dtype: DType]() -> Float32:
    """What one unit of `widen`'s output is worth in code values."""
    comptime if dtype == DType.float8_e4m3fn:
        return 256.0
    else:
        return 1.0


@always_inline
def widen[dtype: DType, width: Int](codes: SIMD[dtype, width]) -> SIMD[DType.float32, width]:
    """Stored elements as float32, in units of `widened_unit[dtype]()`:
    float8 codes through float16 (see the module docstring), anything else
    by a plain cast."""
    comptime if dtype == DType.float8_e4m3fn:
        # s eeee mmm -> float16 s 0 eeee mmm 0000000: the byte to the top of
        # 16 bits, an arithmetic shift right by one, the copied sign cleared.
        var high = bitcast[DType.uint8, width](codes).cast[DType.uint16]() << 8
        var shifted = bitcast[DType.uint16, width](bitcast[DType.int16, width](high) >> 1)
        var half = shifted & 0xBFFF
        return bitcast[DType.float16, width](half).cast[DType.float32]()
    else:
        return codes.cast[DType.float32]()


def encode[dtype: DType, width: Int](scaled: SIMD[DType.float32, width]) -> SIMD[dtype, width]:
    """Codes of values already divided by their scale and clamped to
    `code_max`: int8 rounds to the nearest integer; float8 to the nearest
    code, ties to even, in integer operations on the float32 bits (the
    standard library's float8 cast was the store's bottleneck)."""
    comptime if dtype == DType.int8:
        return rebind[SIMD[dtype, width]](scaled.__round__().cast[DType.int8]())
    else:
        comptime F = SIMD[DType.float32, width]
        comptime U = SIMD[DType.uint32, width]
        var magnitude = abs(scaled)
        var bits = bitcast[DType.uint32, width](magnitude)
        # Normal codes: round the mantissa to 3 bits (ties to even), then
        # rebias the exponent from float32's 127 to e4m3's 7.
        var rounded = bits + U(0x7FFFF) + ((bits >> 20) & U(1))
        var normal = (rounded >> 20) - U(120 << 3)
        # Subnormal codes (below 2^-6): multiples of 2^-9, rounded to even.
        # (Adding and taking away 2^23 rounds a value below it to an integer, ties to even.)
        var steps = (magnitude * F(512) + F(8388608)) - F(8388608)
        var subnormal = steps.cast[DType.uint32]()
        var code = magnitude.lt(F(0.015625)).select(subnormal, normal)
        var sign = (bitcast[DType.uint32, width](scaled) >> 24) & U(0x80)
        return bitcast[dtype, width]((code | sign).cast[DType.uint8]())


comptime QUANT_WIDTH = 8
"""Lanes of float32 the store's quantize loops work in."""


def granule_scale(src: F32Ptr, count: Int, limit: Float32) -> Float32:
    """The largest finite magnitude of `src[0 ..< count]` over `limit`: the
    scale that maps it to the largest code."""
    comptime V = SIMD[DType.float32, QUANT_WIDTH]
    var lanes = V(0)
    var i = 0
    while i + QUANT_WIDTH <= count:
        var x = abs(src.unsafe_load[width=QUANT_WIDTH](i))
        lanes = (x.lt(V(Float32.MAX_FINITE)) & x.gt(lanes)).select(x, lanes)  # NaN compares false
        i += QUANT_WIDTH
    var largest = lanes.reduce_max()
    for j in range(i, count):
        var x = abs(src[unsafe_offset=j])
        if x < Float32.MAX_FINITE and x > largest:
            largest = x
    return largest / limit


@always_inline
def _codes[
    dtype: DType, width: Int
](values: SIMD[DType.float32, width], inv: Float32) -> SIMD[dtype, width]:
    """Codes of `values` times `inv`: saturated to the code range, NaN as 0."""
    comptime limit = code_max[dtype]()
    var x = values * inv
    var clamped = min(max(x, SIMD[DType.float32, width](-limit)), SIMD[DType.float32, width](limit))
    return encode[dtype, width](x.eq(x).select(clamped, SIMD[DType.float32, width](0)))


def quantize[
    dtype: DType
](src: F32Ptr, count: Int, scale: Float32, dst: CachePtr[dtype],):
    """Writes the codes of `src[0 ..< count]` under `scale`: saturating at
    `code_max`, NaN as 0, everything as 0 under a zero scale."""
    var inv = 1 / scale if scale > 0 else Float32(0)
    var i = 0
    while i + QUANT_WIDTH <= count:
        var codes = _codes[dtype, QUANT_WIDTH](src.unsafe_load[width=QUANT_WIDTH](i), inv)
        dst.unsafe_store(i, codes)
        i += QUANT_WIDTH
    for j in range(i, count):
        dst[unsafe_offset=j] = _codes[dtype, 1](src.unsafe_load[width=1](j), inv)


def dequantize[
    dtype: DType
](codes: CachePtr[dtype], count: Int, scale: Float32, dst: F32Ptr,):
    """Writes the values of `codes[0 ..< count]` under `scale` to `dst`."""
    var unit = scale * widened_unit[dtype]()
    for i in range(count):
        dst[unsafe_offset=i] = widen[dtype, 1](codes[unsafe_offset=i]) * unit


def store_quantized[
    cache_t: KVCacheT, src_dtype: DType
](cache: cache_t, bs: Int, first: Int, count: Int, src: CachePtr[src_dtype],):
    """Quantizes `count` token rows at `src` into positions `first ..<
    first + count` of batch row `bs`, one scale block at a time.

    A scale block's scale covers all of its tokens: when new tokens join a
    block that holds some already (`tokens_per_scale` > 1, a decode step) and
    raise its scale, the tokens already there are requantized under the new
    one, so every code of a block always means code * its one scale."""
    comptime dtype = cache_t.dtype
    comptime limit = code_max[dtype]()
    var table = cache.scales()
    var per_block = table.tokens_per_scale
    var n_kv = cache.num_heads()
    var d = cache.head_dim()
    var row = n_kv * d
    var granularity = d // table.granules
    var staged = List[Float32](length=per_block * row, fill=0)
    var block = staged.unsafe_ptr().unsafe_origin_cast[MutUntrackedOrigin]()
    var tok = first
    while tok < first + count:
        var block_start = tok - tok % per_block
        var block_end = min(block_start + per_block, first + count)
        var held = tok - block_start  # tokens already in the block
        for t in range(tok, block_end):
            var from_row = src.unsafe_offset((t - first) * row)
            var to_row = block.unsafe_offset((t - block_start) * row)
            for i in range(row):
                to_row[unsafe_offset=i] = from_row[unsafe_offset=i].cast[DType.float32]()
        var scale_row = cache.scale_row(bs, block_start)
        for h in range(n_kv):
            for g in range(table.granules):
                var at = h * d + g * granularity
                var scale: Float32 = 0
                for t in range(held, block_end - block_start):
                    scale = max(
                        scale, granule_scale(block.unsafe_offset(t * row + at), granularity, limit)
                    )
                var slot = scale_row.unsafe_offset(h * table.granules + g)
                if held > 0:
                    var old = slot[]
                    if scale > old:
                        for t in range(held):
                            var codes = cache.row_ptr(bs, block_start + t).unsafe_offset(at)
                            var values = block.unsafe_offset(t * row + at)
                            dequantize(codes, granularity, old, values)
                            quantize(values, granularity, scale, codes)
                    else:
                        scale = old
                slot[] = scale
                for t in range(held, block_end - block_start):
                    var codes = cache.row_ptr(bs, block_start + t).unsafe_offset(at)
                    quantize(block.unsafe_offset(t * row + at), granularity, scale, codes)
        tok = block_end
    _ = staged^


def load_dequantized[
    cache_t: KVCacheT, dest_dtype: DType
](cache: cache_t, bs: Int, tok: Int, dest: CachePtr[dest_dtype],):
    """Writes token row `tok` of batch row `bs` as values to `dest`."""
    var table = cache.scales()
    var d = cache.head_dim()
    var granularity = d // table.granules
    var codes = cache.row_ptr(bs, tok)
    var scales = cache.scale_row(bs, tok)
    var unit = widened_unit[cache_t.dtype]()
    for g in range(cache.num_heads() * table.granules):
        var scale = scales[unsafe_offset=g] * unit
        for i in range(g * granularity, (g + 1) * granularity):
            dest[unsafe_offset=i] = (widen[cache_t.dtype, 1](codes[unsafe_offset=i]) * scale).cast[
                dest_dtype
            ]()
