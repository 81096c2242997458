"""GGUF weight blocks as stored: the one place that knows their bytes.

A GGUF matrix `[rows, columns]` stores each row as consecutive blocks of 32
weights:

- `q4_1`, 20 bytes: float16 scale `d`, float16 minimum `m`, then 16 bytes
  whose low nibbles are weights 0..15 and high nibbles weights 16..31;
  weight = `d * q + m`.
- `q8_0`, 34 bytes: float16 scale `d`, then 32 int8 `q`; weight = `d * q`.

Kernels read a block through `BlockScales` (its `d` and `m`, loaded once) and
`dequantize[encoding, group]`, which returns weights `GROUP * group ..< GROUP * (group + 1)`
as float32: straight from the stored bytes into a register, exactly the values
`gguf.quants.dequantize` computes (up to the one rounding of the fused
`d * q + m`).
"""

from std.sys import simd_width_of

comptime BytePtr = Pointer[UInt8, MutUntrackedOrigin]
comptime F32Ptr = Pointer[Float32, MutUntrackedOrigin]
comptime GROUP = max(8, simd_width_of[DType.float32]())
"""Weights per `dequantize`: one float32 vector (AVX2: 8, AVX-512: 16; at least 8)."""
comptime Group = SIMD[DType.float32, GROUP]
comptime BLOCK_VALUES = 32
comptime GROUPS = BLOCK_VALUES // GROUP


def block_bytes[encoding: StaticString]() -> Int:
    """Bytes of one block of `encoding`."""
    comptime if encoding == "q4_1":
        return 20
    else:
        comptime assert encoding == "q8_0", "mokv_quant knows q4_1 and q8_0"
        return 34


@always_inline
def _half(block: BytePtr, index: Int) -> Float32:
    return block.unsafe_bitcast[Float16]().unsafe_load(index).cast[DType.float32]()


@fieldwise_init
struct BlockScales(TrivialRegisterPassable):
    """A block's scale `d` and minimum `m` (0 for q8_0), splat over a vector."""

    var d: Group
    var m: Group

    @always_inline
    @staticmethod
    def load[encoding: StaticString](block: BytePtr) -> BlockScales:
        comptime if encoding == "q4_1":
            return BlockScales(Group(_half(block, 0)), Group(_half(block, 1)))
        else:
            return BlockScales(Group(_half(block, 0)), Group(0))


comptime HALF = BLOCK_VALUES // 2
"""Weights per `dequantize_half`: half a block, one AVX-512 vector of float32."""
comptime Half = SIMD[DType.float32, HALF]


@always_inline
def dequantize_half[encoding: StaticString, half: Int](block: BytePtr) -> Half:
    """Weights `16 * half ..< 16 * half + 16` of the block at `block`, its
    scales read here: for one row of activations (a decode step), where a
    block's weights meet one vector of `x` each and nothing is reused."""
    var d = Half(_half(block, 0))
    comptime if encoding == "q4_1":
        var packed = block.unsafe_load[width=HALF](4)
        var q = (packed & 15) if half == 0 else (packed >> 4)
        return q.cast[DType.float32]().fma(d, Half(_half(block, 1)))
    else:
        var q = block.unsafe_bitcast[Int8]().unsafe_load[width=HALF](2 + half * HALF)
        return q.cast[DType.float32]() * d


@always_inline
def dequantize[encoding: StaticString, group: Int](block: BytePtr, scales: BlockScales) -> Group:
    """Weights `GROUP * group ..< GROUP * (group + 1)` of the block at `block`."""
    comptime if encoding == "q4_1":
        # Bytes 0..15 hold weights 0..15 in their low nibbles, 16..31 in their high ones.
        comptime per_nibble = HALF // GROUP
        var packed = block.unsafe_load[width=GROUP](4 + (group % per_nibble) * GROUP)
        var q = (packed & 15) if group < per_nibble else (packed >> 4)
        return q.cast[DType.float32]().fma(scales.d, scales.m)
    else:
        var q = block.unsafe_bitcast[Int8]().unsafe_load[width=GROUP](2 + group * GROUP)
        return q.cast[DType.float32]() * scales.d
