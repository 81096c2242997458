"""Checks the GPU kernels' code conversions (`mokv_kernels.gpu.codes`)
against the CPU's (`mokv_kernels.kv_quantization.widen`, the casts) over
every byte: prints one line per check, `<check> ok` or the first code that
differs (`tests/gpu/test_code_conversions.py`)."""

from std.memory import bitcast

from mokv_kernels.gpu.codes import codes_as_float16, e4m3_as_float16, int8_as_float32
from mokv_kernels.kv_quantization import widen, widened_unit


def every_byte(base: Int) -> SIMD[DType.uint8, 16]:
    """Bytes `base ..< base + 16`."""
    var bytes = SIMD[DType.uint8, 16]()
    for i in range(16):
        bytes[i] = UInt8(base + i)
    return bytes


def main():
    var e4m3_bad = -1
    var e4m3_float16_bad = -1
    var int8_bad = -1
    var int8_float16_bad = -1
    for base in range(0, 256, 16):
        var bytes = every_byte(base)
        var e4m3 = bitcast[DType.float8_e4m3fn, 16](bytes)
        var pairs = e4m3_as_float16[16](e4m3).cast[DType.float32]()
        var one_by_one = widen[DType.float8_e4m3fn, 16](e4m3)
        var exact = codes_as_float16[DType.float8_e4m3fn, 16](e4m3).cast[DType.float32]()
        var value = one_by_one * widened_unit[DType.float8_e4m3fn]()
        var int8 = bitcast[DType.int8, 16](bytes)
        var biased = int8_as_float32[16](int8)
        var cast = int8.cast[DType.float32]()
        var int8_exact = codes_as_float16[DType.int8, 16](int8).cast[DType.float32]()
        for i in range(16):
            var same_bits = bitcast[DType.uint32](pairs[i]) == bitcast[DType.uint32](one_by_one[i])
            if not same_bits and e4m3_bad < 0:
                e4m3_bad = base + i
            var nan_code = (base + i) & 0x7F == 0x7F  # never stored
            if not nan_code and exact[i] != value[i] and e4m3_float16_bad < 0:
                e4m3_float16_bad = base + i
            if biased[i] != cast[i] and int8_bad < 0:
                int8_bad = base + i
            if int8_exact[i] != cast[i] and int8_float16_bad < 0:
                int8_float16_bad = base + i
    print("e4m3 ok" if e4m3_bad < 0 else String("e4m3 differs at byte ", e4m3_bad))
    print("int8 ok" if int8_bad < 0 else String("int8 differs at byte ", int8_bad))
    print(
        "e4m3 float16 ok" if e4m3_float16_bad
        < 0 else String("e4m3 float16 differs at byte ", e4m3_float16_bad)
    )
    print(
        "int8 float16 ok" if int8_float16_bad
        < 0 else String("int8 float16 differs at byte ", int8_float16_bad)
    )
