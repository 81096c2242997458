"""Widening float8_e4m3fn codes to float32 on a CPU without float8
instructions: the standard library's cast, a 256-entry lookup table, and the
float16 bit move of `mokv_kernels.kv_quantization.widen`, against widening int8 codes.
It first checks `widen` against the cast on every non-NaN code.

Run: .venv/bin/mojo run -I mojo tools/fp8_conversion_bench.mojo
"""

from std.memory import bitcast
from std.time import perf_counter_ns

from mokv_kernels.kv_quantization import widen, widened_unit
from mokv_kernels.pointers import BytePtr, F32Ptr

comptime W = 8
comptime V = SIMD[DType.float32, W]
comptime CODES = 1 << 16
comptime REPEATS = 2000


@always_inline
def stdlib_cast(codes: BytePtr, i: Int, table: F32Ptr) -> V:
    return bitcast[DType.float8_e4m3fn, W](codes.unsafe_load[width=W](i)).cast[DType.float32]()


@always_inline
def lookup_table(codes: BytePtr, i: Int, table: F32Ptr) -> V:
    var out = V(0)
    comptime for k in range(W):
        out[k] = table[unsafe_offset=Int(codes[unsafe_offset=i + k])]
    return out


@always_inline
def float16_bits(codes: BytePtr, i: Int, table: F32Ptr) -> V:
    return widen[DType.float8_e4m3fn, W](
        bitcast[DType.float8_e4m3fn, W](codes.unsafe_load[width=W](i))
    )


@always_inline
def int8_codes(codes: BytePtr, i: Int, table: F32Ptr) -> V:
    return widen[DType.int8, W](bitcast[DType.int8, W](codes.unsafe_load[width=W](i)))


def elements_per_ns[
    convert: def(BytePtr, Int, F32Ptr) thin -> V
](codes: BytePtr, table: F32Ptr) -> Float64:
    var best = Int.MAX
    var total = V(0)
    for _ in range(5):
        var start = perf_counter_ns()
        for _ in range(REPEATS):
            # Four sums, so the adds' latency does not bound the loop.
            var sums = Array[V, 4](fill=V(0))
            for i in range(0, CODES, 4 * W):
                comptime for k in range(4):
                    sums[k] += convert(codes, i + k * W, table)
            total += sums[0] + sums[1] + sums[2] + sums[3]
        best = min(best, Int(perf_counter_ns() - start))
    if total[0] == 1.5:  # keeps the sums alive
        print("")
    return Float64(CODES) * REPEATS / Float64(best)


def main() raises:
    var storage = List[UInt8](length=CODES, fill=0)
    var codes = storage.unsafe_ptr().unsafe_origin_cast[MutUntrackedOrigin]()
    for i in range(CODES):
        codes[unsafe_offset=i] = UInt8((i * 37 + 11) % 256) & 0xFE  # no NaN codes (0x7F, 0xFF)
    var table_storage = List[Float32](length=256, fill=0)
    var table = table_storage.unsafe_ptr().unsafe_origin_cast[MutUntrackedOrigin]()
    var mismatches = 0
    for c in range(256):
        var code = bitcast[DType.float8_e4m3fn, 1](UInt8(c))
        table[unsafe_offset=c] = code.cast[DType.float32]()
        var widened = widen[DType.float8_e4m3fn, 1](code) * widened_unit[DType.float8_e4m3fn]()
        if (c & 0x7F) != 0x7F and widened != table[unsafe_offset=c]:
            mismatches += 1
            print("code", c, "widens to", widened, "but is", table[unsafe_offset=c])
    if mismatches:
        raise Error(t"widen disagrees with the float8 cast on {mismatches} codes")
    print("widen agrees with the float8 cast on every non-NaN code")
    print("stdlib float8 cast:", elements_per_ns[stdlib_cast](codes, table), "elements/ns")
    print("lookup table:      ", elements_per_ns[lookup_table](codes, table), "elements/ns")
    print("float16 bit move:  ", elements_per_ns[float16_bits](codes, table), "elements/ns")
    print("int8 cast:         ", elements_per_ns[int8_codes](codes, table), "elements/ns")
    _ = storage^
    _ = table_storage^
