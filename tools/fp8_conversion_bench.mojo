"""Widening float8_e4m3fn codes to float32 on a CPU without float8
instructions: the standard library's cast, a 256-entry lookup table, and the
float16 bit move that `mokv_kernels.quant.widen` uses, against widening int8.
Checks the bit move against the cast on every non-NaN code first.

Run: .venv/bin/mojo run tools/fp8_conversion_bench.mojo
"""

from std.time import perf_counter_ns
from std.memory import bitcast

comptime W = 8
comptime V = SIMD[DType.float32, W]


def fill(p: Pointer[UInt8, MutUntrackedOrigin], n: Int):
    for i in range(n):
        p[unsafe_offset=i] = UInt8((i * 37 + 11) % 256) & 0x7E  # avoid NaN codes (0x7F)


@always_inline
def conv_builtin(p: Pointer[UInt8, MutUntrackedOrigin], i: Int) -> V:
    var raw = p.unsafe_load[width=W](i)
    return bitcast[DType.float8_e4m3fn, W](raw).cast[DType.float32]()


@always_inline
def conv_f16(p: Pointer[UInt8, MutUntrackedOrigin], i: Int) -> V:
    # e4m3 bits moved into f16 positions: value * 2^-8, exact incl. subnormals
    var raw = p.unsafe_load[width=W](i).cast[DType.uint16]()
    var bits = ((raw & 0x80) << 8) | ((raw & 0x7F) << 7)
    return bitcast[DType.float16, W](bits).cast[DType.float32]()


@always_inline
def conv_i8(p: Pointer[UInt8, MutUntrackedOrigin], i: Int) -> V:
    var raw = p.unsafe_load[width=W](i)
    return bitcast[DType.int8, W](raw).cast[DType.float32]()


def main() raises:
    comptime N = 1 << 16
    var store = List[UInt8](length=N, fill=0)
    var buf = store.unsafe_ptr().unsafe_origin_cast[MutUntrackedOrigin]()
    fill(buf, N)
    var lstore = List[Float32](length=256, fill=0)
    var lut = lstore.unsafe_ptr().unsafe_origin_cast[MutUntrackedOrigin]()
    for c in range(256):
        lut[unsafe_offset=c] = bitcast[DType.float8_e4m3fn, 1](UInt8(c)).cast[DType.float32]()
    # correctness: f16 trick * 256 == builtin for all non-NaN codes
    var bad = 0
    for c in range(256):
        if (c & 0x7F) == 0x7F:
            continue
        var b = UInt8(c)
        var raw = UInt16(b)
        var bits = ((raw & 0x80) << 8) | ((raw & 0x7F) << 7)
        var f = bitcast[DType.float16, 1](bits).cast[DType.float32]() * 256
        if f != lut[unsafe_offset=c]:
            bad += 1
            print("mismatch", c, f, lut[unsafe_offset=c])
    print("f16-trick mismatches:", bad)
    comptime REPS = 2000
    var acc = V(0)
    for method in range(4):
        var best = Int.MAX
        for _ in range(5):
            var t0 = perf_counter_ns()
            for _ in range(REPS):
                var s = V(0)
                for i in range(0, N, W):
                    if method == 0:
                        s += conv_builtin(buf, i)
                    elif method == 1:
                        s += conv_f16(buf, i)
                    elif method == 2:
                        var v = V(0)
                        for k in range(W):
                            v[k] = lut[unsafe_offset=Int(buf[unsafe_offset=i + k])]
                        s += v
                    else:
                        s += conv_i8(buf, i)
                acc += s
            best = min(best, Int(perf_counter_ns() - t0))
        var names = ["builtin cast", "f16 bit trick", "lookup table", "int8 cast"]
        print(names[method], Float64(N) * REPS / Float64(best), "elements/ns")
    print(acc[0], len(store), len(lstore))
