"""Warp-collective steps that one kernel source runs two ways: as the NVIDIA
instructions on a GPU, and emulated on the CPU.

A tensor-core kernel's registers are held per lane: `Array[T, lanes]`. On
a GPU a program is one thread, `lanes == 1`, and each step is the hardware
instruction on the thread's own registers (`ld_matrix`, `mma`,
`shuffle_xor`). Under the emulator (`block.Emulator`) a program is a whole
warp, `lanes == 32`, its registers every lane's, and each step computes
what the instruction documents for every lane at once from all of them. So
the kernel's tile loops, paging, masking and online softmax run thread by
thread on the CPU against the same fragment layouts the hardware uses
(PTX ISA, "Matrix Fragments for mma.m16n8k16" and "ldmatrix"):

- `mma` m16n8k16, bfloat16 A and B, float32 C and D. With `g = lane // 4`
  and `t = lane % 4`: A (16 x 16, row-major) is 8 values per lane, pairs
  (row g, cols 2t, 2t+1), (row g + 8, same cols), (row g, cols 2t + 8,
  2t + 9), (row g + 8, those); B (16 x 8, k x n) is 4 values, (rows 2t,
  2t + 1, col g) then (rows 2t + 8, 2t + 9, col g); C and D (16 x 8) are
  4 values, (row g, cols 2t, 2t + 1) then (row g + 8, those).
- `ld_matrix` of `count` = 1, 2 or 4 matrices of 8 x 8 16-bit values: lanes
  8i .. 8i + 7 give the addresses of matrix i's rows 0 .. 7; lane l gets,
  per matrix, the pair (row l // 4, cols 2(l % 4), 2(l % 4) + 1), or
  transposed (rows 2(l % 4), 2(l % 4) + 1, col l // 4).
- `shuffle_xor`: lane l gets lane `l ^ mask`'s value.

The emulated steps see a warp as one unit, so they cannot show a missing
`__syncwarp` between lanes of one warp, nor timing; `tests/gpu/
test_warp_emulation.py` checks them against numpy on random fragments.
"""

from max.gpu.compute.mma import ld_matrix as hw_ld_matrix
from max.gpu.compute.mma import mma as hw_mma
from max.gpu.primitives.warp import shuffle_xor as hw_shuffle_xor
from std.memory import AddressSpace

comptime WARP_LANES = 32
comptime BF16Ptr = Pointer[BFloat16, MutUntrackedOrigin]
comptime FragA = SIMD[DType.bfloat16, 8]
"""A thread's share of an m16n8k16 A operand (16 x 16 bfloat16)."""
comptime FragB = SIMD[DType.bfloat16, 4]
"""A thread's share of a B operand (16 x 8 bfloat16)."""
comptime FragC = SIMD[DType.float32, 4]
"""A thread's share of a C or D operand (16 x 8 float32)."""


def _check_lanes[lanes: Int]():
    comptime assert lanes == 1 or lanes == WARP_LANES, "a program is one thread or one warp"


@always_inline
def ld_matrix[
    count: Int, transpose: Bool, lanes: Int
](rows: Array[BF16Ptr, lanes]) -> Array[SIMD[DType.bfloat16, 2 * count], lanes]:
    """`ldmatrix.sync.aligned.m8n8.x{count}[.trans].b16` from shared memory:
    `rows[l]` is the row address lane l gives (16 bytes, 16-byte aligned;
    only lanes below `8 * count` are read)."""
    _check_lanes[lanes]()
    comptime assert count == 1 or count == 2 or count == 4, "ldmatrix loads 1, 2 or 4 matrices"
    var out = Array[SIMD[DType.bfloat16, 2 * count], lanes](fill=0)
    comptime if lanes == 1:
        out[0] = hw_ld_matrix[2 * count, transpose=transpose](
            rows[0].unsafe_address_space_cast[AddressSpace.SHARED]()
        )
    else:
        for l in range(lanes):
            comptime for i in range(count):
                comptime for e in range(2):
                    var value: BFloat16
                    comptime if transpose:
                        value = rows[8 * i + 2 * (l % 4) + e][unsafe_offset=l // 4]
                    else:
                        value = rows[8 * i + l // 4][unsafe_offset=2 * (l % 4) + e]
                    out[l][2 * i + e] = value
    return out^


@always_inline
def mma[
    lanes: Int
](a: Array[FragA, lanes], b: Array[FragB, lanes], c: Array[FragC, lanes]) -> Array[FragC, lanes]:
    """`mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32`: D = A B + C,
    products and sums in float32."""
    _check_lanes[lanes]()
    var d = Array[FragC, lanes](fill=0)
    comptime if lanes == 1:
        var result = FragC(0)
        hw_mma(result, a[0], b[0], c[0])
        d[0] = result
    else:
        for l in range(lanes):
            var g = l // 4
            var t = l % 4
            comptime for e in range(4):
                var row = g + 8 * (e // 2)
                var col = 2 * t + e % 2
                var total = c[l][e]
                for k in range(16):
                    # The lane and value that hold A's (row, k) and B's (k, col).
                    var a_lane = 4 * (row % 8) + (k % 8) // 2
                    var a_value = 2 * (row // 8) + 4 * (k // 8) + k % 2
                    var b_lane = 4 * col + (k % 8) // 2
                    var b_value = 2 * (k // 8) + k % 2
                    total += (
                        a[a_lane][a_value].cast[DType.float32]()
                        * b[b_lane][b_value].cast[DType.float32]()
                    )
                d[l][e] = total
    return d^


@always_inline
def shuffle_xor[lanes: Int](values: Array[Float32, lanes], mask: Int) -> Array[Float32, lanes]:
    """`shfl.sync.bfly`: lane l gets lane `l ^ mask`'s value."""
    _check_lanes[lanes]()
    var out = Array[Float32, lanes](fill=0)
    comptime if lanes == 1:
        out[0] = hw_shuffle_xor(values[0], UInt32(mask))
    else:
        for l in range(lanes):
            out[l] = values[l ^ mask]
    return out^
