"""Rows of GGUF weight blocks, laid out planar: the one place that knows their bytes.

A GGUF matrix `[rows, columns]` stores each row as consecutive blocks of 32
weights:

- `q4_1`, 20 bytes: float16 scale `d`, float16 minimum `m`, then 16 bytes
  whose low nibbles are weights 0..15 and high nibbles weights 16..31;
  weight = `d * q + m`.
- `q8_0`, 34 bytes: float16 scale `d`, then 32 int8 `q`; weight = `d * q`.

mokv keeps exactly these bytes but moves each row's fields into planes
(`mokv_models.weight_formats.BlockEncoding.planar`): the codes of all its blocks,
then all their `d`, then (q4_1) all their `m`. A row is the same size, and a
decode step's product converts sixteen scales with one instruction and reads
each from memory as it needs it, where the interleaved blocks cost a
conversion and two shuffles per block.

Kernels read a row through `BlockRow`: `scales(b)` (block `b`'s `d` and `m`,
splat) with `dequantize[group](b, scales)`, which returns weights
`GROUP * group ..< GROUP * (group + 1)` as float32, exactly the values
`gguf.quants.dequantize` computes (up to the one rounding of the fused
`d * q + m`); or the raw codes (`codes`) and the scale planes (`d`, `m`) for
products that apply the scales once per block.
"""

from std.sys import simd_width_of

from .pointers import BytePtr, F16Ptr

comptime GROUP = max(8, simd_width_of[DType.float32]())
"""Weights per `dequantize`: one float32 vector (AVX2: 8, AVX-512: 16; at least 8)."""
comptime Group = SIMD[DType.float32, GROUP]
comptime BLOCK_VALUES = 32
comptime GROUPS = BLOCK_VALUES // GROUP
comptime HALF = BLOCK_VALUES // 2
"""Half a block: the codes of one nibble of a q4_1 block's bytes."""


def block_bytes[encoding: StaticString]() -> Int:
    """Bytes of one block of `encoding`, fields included."""
    comptime if encoding == "q4_1":
        return 20
    else:
        comptime assert encoding == "q8_0", "mokv_weights knows q4_1 and q8_0"
        return 34


def code_bytes[encoding: StaticString]() -> Int:
    """Bytes of one block's codes."""
    return 16 if encoding == "q4_1" else 32


@fieldwise_init
struct BlockScales(TrivialRegisterPassable):
    """A block's scale `d` and minimum `m` (0 for q8_0), splat over a vector."""

    var d: Group
    var m: Group


struct BlockRow[encoding: StaticString](TrivialRegisterPassable):
    """One planar row of `blocks` blocks of `encoding`."""

    var codes_plane: BytePtr
    var d: F16Ptr
    """The blocks' scales, one float16 each."""
    var m: F16Ptr
    """The blocks' minimums (q4_1; for q8_0 it points at `d`, never read)."""

    @always_inline
    def __init__(out self, row: BytePtr, blocks: Int):
        comptime CB = code_bytes[Self.encoding]()
        self.codes_plane = row
        self.d = row.unsafe_offset(blocks * CB).unsafe_bitcast[Float16]()
        comptime if Self.encoding == "q4_1":
            self.m = self.d.unsafe_offset(blocks)
        else:
            self.m = self.d

    @always_inline
    def scales(self, b: Int) -> BlockScales:
        var d = Group(self.d[unsafe_offset=b].cast[DType.float32]())
        comptime if Self.encoding == "q4_1":
            return BlockScales(d, Group(self.m[unsafe_offset=b].cast[DType.float32]()))
        else:
            return BlockScales(d, Group(0))

    @always_inline
    def codes[width: Int, part: Int](self, b: Int) -> SIMD[DType.float32, width]:
        """Block `b`'s codes `width * part ..< width * (part + 1)` as float32 (`q`,
        unscaled); `width` divides 16."""
        comptime CB = code_bytes[Self.encoding]()
        comptime first = width * part
        comptime if Self.encoding == "q4_1":
            # Bytes 0..15 hold codes 0..15 in their low nibbles, 16..31 in their high ones.
            # Each byte is widened as it loads and split afterwards: splitting the bytes
            # first costs a shuffle per vector to widen them.
            var packed = self.codes_plane.unsafe_load[width=width](b * CB + first % HALF)
            var wide = packed.cast[DType.int32]()
            var q = (wide & 15) if first < HALF else (wide >> 4)
            return q.cast[DType.float32]()
        else:
            var q = self.codes_plane.unsafe_bitcast[Int8]().unsafe_load[width=width](b * CB + first)
            return q.cast[DType.float32]()

    @always_inline
    def dequantize[group: Int](self, b: Int, scales: BlockScales) -> Group:
        """Weights `GROUP * group ..< GROUP * (group + 1)` of block `b`."""
        var q = self.codes[GROUP, group](b)
        comptime if Self.encoding == "q4_1":
            return q.fma(scales.d, scales.m)
        else:
            return q * scales.d
