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

- `mma` m16n8k16, bfloat16 (or float16) A and B, float32 C and D. With `g = lane // 4`
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

On other GPUs `mma` and `ld_matrix` abort: kernels that use them compile
for every target, and the ops launch them only where `Launcher.tensor_cores`
says so. The emulated steps see a warp as one unit, so they cannot show a missing
`__syncwarp` between lanes of one warp, nor timing; `tests/gpu/
test_warp_emulation.py` checks them against numpy on random fragments.
"""

from max.gpu import syncwarp
from max.gpu.compute.mma import ld_matrix as hw_ld_matrix
from max.gpu.compute.mma import mma as hw_mma
from max.gpu.primitives.warp import shuffle_idx as hw_shuffle_idx
from max.gpu.primitives.warp import shuffle_xor as hw_shuffle_xor
from std.memory import AddressSpace, bitcast
from std.os import abort
from std.sys.info import is_nvidia_gpu

from ..pointers import BF16Ptr

comptime WARP = 32
"""Threads (lanes) of an NVIDIA warp, the unit the kernels' row layouts are cut
in: one program under the emulator."""
comptime NOT_NVIDIA = "mma.sync and ldmatrix exist only on NVIDIA GPUs (Launcher.tensor_cores)"
comptime MMA_ROWS = 16
"""Rows of an m16n8k16 product's A and C: one warp's query rows."""
comptime FragA = SIMD[DType.bfloat16, 8]
"""A thread's share of an m16n8k16 A operand (16 x 16 bfloat16)."""
comptime FragB = SIMD[DType.bfloat16, 4]
"""A thread's share of a B operand (16 x 8 bfloat16). Float16 operands travel
in the same registers, typed bfloat16 (their bits), to the one step that
multiplies them (`mma`): per-lane arrays of float16 vectors cost the GPU
build register moves and branches around every product that bfloat16 ones
do not."""
comptime FragC = SIMD[DType.float32, 4]
"""A thread's share of a C or D operand (16 x 8 float32)."""


@always_inline
def fragment_row(first_row: Int, lane: Int, h: Int) -> Int:
    """The row of lane `lane`'s C fragment values `2 h` and `2 h + 1` (`g`,
    or `g + 8`, in the layout above) in a tile where the product's rows start
    at `first_row`."""
    return first_row + lane // 4 + 8 * h


def check_lanes[lanes: Int]():
    """A program is one thread (on a GPU) or one warp (emulated)."""
    comptime assert lanes == 1 or lanes == WARP, "a program is one thread or one warp"


@always_inline
def each_lane[body_t: def(Int) -> None, //, lanes: Int](body: body_t):
    """Runs `body` for every lane of a program. On a GPU (one lane) it is
    the body once, with no loop: a loop over one lane left ptxas's code
    moves and branches around the products. Emulated, it is a loop: 32
    unrolled copies of every step made the emulator's build minutes longer."""
    check_lanes[lanes]()
    comptime if lanes == 1:
        body(0)
    else:
        for l in range(lanes):
            body(l)


@always_inline
def warp_barrier[lanes: Int]():
    """`bar.warp.sync` (`__syncwarp`): the lanes' shared-memory writes before
    it are seen by every lane after it. Under the emulator a program is the
    whole warp, whose lanes run in order: nothing to wait for."""
    check_lanes[lanes]()
    comptime if lanes == 1:
        comptime if is_nvidia_gpu():
            syncwarp()
        else:
            abort(NOT_NVIDIA)


@always_inline
def ld_matrix[
    count: Int, transpose: Bool, lanes: Int
](rows: Array[BF16Ptr, lanes]) -> Array[SIMD[DType.bfloat16, 2 * count], lanes]:
    """`ldmatrix.sync.aligned.m8n8.x{count}[.trans].b16` from shared memory:
    `rows[l]` is the row address lane l gives (16 bytes, 16-byte aligned;
    only lanes below `8 * count` are read)."""
    check_lanes[lanes]()
    comptime assert count == 1 or count == 2 or count == 4, "ldmatrix loads 1, 2 or 4 matrices"
    var out = Array[SIMD[DType.bfloat16, 2 * count], lanes](fill=0)
    comptime if lanes == 1:
        comptime if is_nvidia_gpu():
            out[0] = hw_ld_matrix[2 * count, transpose=transpose](
                rows[0].unsafe_address_space_cast[AddressSpace.SHARED]()
            )
        else:
            abort(NOT_NVIDIA)
    else:
        out = rebind[Array[SIMD[DType.bfloat16, 2 * count], lanes]](
            _emulated_ld_matrix[count, transpose](rebind[Array[BF16Ptr, WARP]](rows))
        ).copy()
    return out^


@always_inline
def mma[
    lanes: Int, dtype: DType = DType.bfloat16
](a: Array[FragA, lanes], b: Array[FragB, lanes], c: Array[FragC, lanes]) -> Array[FragC, lanes]:
    """`mma.sync.aligned.m16n8k16.row.col.f32.{bf16,f16}.{bf16,f16}.f32`: D =
    A B + C, products and sums in float32, A and B values of `dtype`
    (bfloat16, or float16 carried as bits in bfloat16 registers: `FragB`)."""
    check_lanes[lanes]()
    comptime assert (
        dtype == DType.bfloat16 or dtype == DType.float16
    ), "tensor-core operands are bfloat16 or float16"
    var d = Array[FragC, lanes](fill=0)
    comptime if lanes == 1:
        comptime if is_nvidia_gpu():
            var result = FragC(0)
            hw_mma(result, bitcast[dtype, 8](a[0]), bitcast[dtype, 4](b[0]), c[0])
            d[0] = result
        else:
            abort(NOT_NVIDIA)
    else:
        d = rebind[Array[FragC, lanes]](
            _emulated_mma[dtype](
                rebind[Array[FragA, WARP]](a),
                rebind[Array[FragB, WARP]](b),
                rebind[Array[FragC, WARP]](c),
            )
        ).copy()
    return d^


@no_inline
def _emulated_ld_matrix[
    count: Int, transpose: Bool
](rows: Array[BF16Ptr, WARP]) -> Array[SIMD[DType.bfloat16, 2 * count], WARP]:
    """Every lane's `ld_matrix` result (a call, not inlined: the emulator's
    build would otherwise copy it into every step of every kernel)."""
    var out = Array[SIMD[DType.bfloat16, 2 * count], WARP](fill=0)
    for l in range(WARP):
        for i in range(count):
            for e in range(2):
                if transpose:
                    out[l][2 * i + e] = rows[8 * i + 2 * (l % 4) + e][unsafe_offset=l // 4]
                else:
                    out[l][2 * i + e] = rows[8 * i + l // 4][unsafe_offset=2 * (l % 4) + e]
    return out^


@no_inline
def _emulated_mma[
    dtype: DType
](a: Array[FragA, WARP], b: Array[FragB, WARP], c: Array[FragC, WARP]) -> Array[FragC, WARP]:
    """Every lane's `mma` result: each D element from the lanes and values
    that hold its row of A and its column of B."""
    var d = Array[FragC, WARP](fill=0)
    for l in range(WARP):
        var g = l // 4
        var t = l % 4
        for e in range(4):
            var row = g + 8 * (e // 2)
            var col = 2 * t + e % 2
            var total = c[l][e]
            for k in range(16):
                var a_lane = 4 * (row % 8) + (k % 8) // 2
                var a_value = 2 * (row // 8) + 4 * (k // 8) + k % 2
                var b_lane = 4 * col + (k % 8) // 2
                var b_value = 2 * (k // 8) + k % 2
                total += (
                    bitcast[dtype](a[a_lane][a_value]).cast[DType.float32]()
                    * bitcast[dtype](b[b_lane][b_value]).cast[DType.float32]()
                )
            d[l][e] = total
    return d^


@always_inline
def warp_uniform(value: Int) -> Int:
    """`value`, which every lane of the warp holds alike, taken from lane 0
    (`shfl.sync.idx`, 32 bits): a value ptxas always takes as the warp's.
    ptxas computes on the warp's uniform datapath, once a warp, only what it
    can tell is the warp's, and a `wgmma` reads its descriptors from uniform
    registers: descriptors it computes per thread it copies in at each use
    (`R2UR`). The emulator's lanes hold the value already."""
    comptime if is_nvidia_gpu():
        return Int(hw_shuffle_idx(UInt32(value), 0))
    else:
        return value


@always_inline
def shuffle_xor[lanes: Int](values: Array[Float32, lanes], mask: Int) -> Array[Float32, lanes]:
    """`shfl.sync.bfly`: lane l gets lane `l ^ mask`'s value."""
    check_lanes[lanes]()
    var out = Array[Float32, lanes](fill=0)
    comptime if lanes == 1:
        out[0] = hw_shuffle_xor(values[0], UInt32(mask))
    else:
        for l in range(lanes):
            out[l] = values[l ^ mask]
    return out^


struct Frags[dtype: DType, width: Int, count: Int, lanes: Int](Copyable):
    """`count` fragments of `width` values per lane, for `lanes` lanes: a
    thread's (or, emulated, a warp's) registers for a tile of fragments."""

    comptime Lane = SIMD[Self.dtype, Self.width]
    var data: Array[Self.Lane, Self.count * Self.lanes]

    @always_inline
    def __init__(out self, fill: Scalar[Self.dtype]):
        self.data = Array[Self.Lane, Self.count * Self.lanes](fill=Self.Lane(fill))

    @always_inline
    def __getitem__(self, i: Int, l: Int) -> Self.Lane:
        """Fragment `i` of lane `l`."""
        return self.data[i * Self.lanes + l]

    @always_inline
    def __setitem__(mut self, i: Int, l: Int, value: Self.Lane):
        self.data[i * Self.lanes + l] = value

    @always_inline
    def get(self, i: Int) -> Array[Self.Lane, Self.lanes]:
        """Fragment `i` of every lane, as a warp step takes it."""
        var out = Array[Self.Lane, Self.lanes](fill=0)
        for l in range(Self.lanes):
            out[l] = self[i, l]
        return out^

    @always_inline
    def set(mut self, i: Int, values: Array[Self.Lane, Self.lanes]):
        for l in range(Self.lanes):
            self[i, l] = values[l]
