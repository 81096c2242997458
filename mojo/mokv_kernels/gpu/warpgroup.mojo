"""Hopper's warpgroup MMA (`wgmma.mma_async`, sm_90a), run two ways as the
steps of `..warp` are: the instruction on a GPU, emulated on the CPU.

A warpgroup is four consecutive warps. One `wgmma` m64nNk16 computes
D = A B + D for A `[64, 16]` and B `[16, N]` bfloat16 with float32 D: warp
w of the group holds rows 16 w .. 16 w + 15 of A (when A is in registers)
and of D, in the layouts of `mma.sync` m16n8k16 (`..warp`: an A fragment
per warp, one C fragment per 8 columns of D). B, and A when it is not in
registers, are read by the tensor cores from shared memory through a
descriptor (`SharedOperand`), never through the threads' registers: a K/V
tile is read once per warpgroup, not once per warp.

Shared-memory operands use the 128-byte swizzle (`.swizzle`). The same tile is a K-major operand (its rows are M or N,
its columns K: the queries as A, the keys as B of Q Kᵀ) or an MN-major one
(its rows are K: the values as B of P V). Under the emulator an operand's
elements are read through the PTX ISA's canonical layouts ("Shared Memory
Matrix Layout": strides LBO and SBO, then the swizzle on the address bits),
written here from the ISA, not from the kernels' own address function,
so a kernel whose copies and descriptors disagree fails its emulated tests.

The instruction is asynchronous: `warpgroup_arrive` before a batch of them
(after the registers they read were written), `warpgroup_wait` before their
results are read. Shared memory written by ordinary stores or `cp.async`
(the generic proxy) is seen by them only after `async_proxy_fence` and a
barrier. Emulated, a program is one warp and does its own rows; arrive,
wait and the fence do nothing there. On GPUs other than Hopper the steps
abort: the ops launch them only where `Launcher.warpgroup_mma` says so.
"""

from max.gpu.compute.mma import (
    WGMMADescriptor,
    wgmma_async,
    wgmma_commit_group_sync,
    wgmma_fence_aligned,
    wgmma_wait_group_sync,
)
from max.gpu.host.nvidia.tma import TensorMapSwizzle
from max.gpu.memory import fence_async_view_proxy
from std.memory import AddressSpace
from std.os import abort
from std.sys._assembly import inlined_assembly
from std.sys.info import is_nvidia_gpu

from .shared_memory import SharedMemory
from .swizzle import SWIZZLE_BYTES, SWIZZLE_COLUMNS
from .warp import WARP, FragA, Frags, check_lanes

comptime NOT_HOPPER = "wgmma exists only on NVIDIA Hopper GPUs (Launcher.warpgroup_mma)"
comptime WARPGROUP_ROWS = 64
"""Rows of a warpgroup product: 16 per warp."""
comptime WARPGROUP_WARPS = 4
comptime K = 16
"""Depth of one bfloat16 warpgroup product."""


@fieldwise_init
struct SharedOperand[k_major: Bool, lbo: Int, sbo: Int](TrivialRegisterPassable):
    """One `wgmma` operand's `[16, N]` (B) or `[64, 16]` (A) slice of a
    128-byte-swizzled tile: K-major (its rows are N or M, 8-row groups
    `sbo` bytes apart; `lbo` unused, 16) or MN-major (its rows are K,
    8-row groups `sbo` bytes apart, 64-column blocks `lbo` bytes apart)."""

    var tile: SharedMemory
    """The tile, 1024-byte aligned. Its descriptors are made of its 32-bit
    address: from the generic pointer ptxas converted the address in every
    thread (reading the shared window, `S2R SR_SWINHI`), and kept the
    descriptors made of it in thread registers, copied into uniform ones at
    every product. The emulator reads its elements through the pointer."""
    var start: Int
    """Bytes from the tile to the slice's first element, before swizzling."""

    comptime HIGH_WORD = UInt32(Self.sbo >> 4) | UInt32(1) << 30
    """A descriptor's bits 32-63: the stride (bits 32-45) and the 128-byte
    swizzle (mode 1, bits 62-63)."""
    comptime LEADING = UInt32(Self.lbo >> 4) << 16
    """A descriptor's leading byte offset field (bits 16-29)."""

    @always_inline
    def descriptor(self) -> WGMMADescriptor[DType.bfloat16]:
        """The shared-memory matrix descriptor the instruction reads, made
        from the slice's address (`WGMMADescriptor.create`). For an operand
        whose tile stays (the queries): LLVM computes its slices' descriptors
        once, outside the tile loop."""
        var slice = Pointer[BFloat16, MutUntrackedOrigin, address_space=AddressSpace.SHARED](
            unsafe_from_address=Int(self.tile.address) + self.start
        )
        return WGMMADescriptor[DType.bfloat16].create[
            Self.sbo >> 4, Self.lbo >> 4, TensorMapSwizzle.SWIZZLE_128B
        ](slice)

    @always_inline
    def advanced_descriptor(self) -> WGMMADescriptor[DType.bfloat16]:
        """`descriptor`'s bits, made as the tile's descriptor advanced by the
        slice's start, for an operand whose tile changes every tile (keys,
        values): the slices of one tile then differ by one 64-bit add of a
        constant (`UIADD3.64` into each product's uniform registers, where
        a low word joined to the high one took a move of each), where
        `create` masked each slice's address anew. Exact while the tile's
        shared-memory address plus the start stays below 256 KB, as every
        shared address does, so the address field (bits 0-13, the address
        over 16) never carries. Not for the queries: their descriptors from
        one base took the producer-fed prefills 4 to 8 instructions more a
        tile."""
        var low = (self.tile.address & 0x3FFFF) >> 4 | Self.LEADING
        var tile = Int64(Self.HIGH_WORD) << 32 | Int64(low)
        return WGMMADescriptor[DType.bfloat16](tile + Int64(self.start >> 4))

    def element(self, k: Int, mn: Int) -> Float32:
        """Element (k, mn) of the slice, found as the hardware finds it."""
        var byte: Int
        comptime if Self.k_major:
            byte = self.start + mn // 8 * Self.sbo + mn % 8 * SWIZZLE_BYTES + 2 * k
        else:
            byte = (
                self.start
                + mn // SWIZZLE_COLUMNS * Self.lbo
                + 2 * (mn % SWIZZLE_COLUMNS)
                + k // 8 * Self.sbo
                + k % 8 * SWIZZLE_BYTES
            )
        byte ^= (byte >> 7) % 8 << 4
        return self.tile.generic.unsafe_bitcast[BFloat16]()[unsafe_offset=byte // 2].cast[
            DType.float32
        ]()


comptime KMajor = SharedOperand[True, 16, 8 * SWIZZLE_BYTES]
"""A K-major slice of a swizzled tile (queries, keys)."""
comptime MNMajor[rows: Int] = SharedOperand[False, rows * SWIZZLE_BYTES, 8 * SWIZZLE_BYTES]
"""An MN-major slice of a swizzled tile of `rows` rows (values)."""


@always_inline
def k_slice(tile: SharedMemory, rows: Int, step: Int, first_row: Int = 0) -> KMajor:
    """The K-major slice of k-step `step` (columns 16 step ..) of a tile of
    `rows` rows, from row `first_row` (a multiple of 8) on."""
    comptime steps_per_block = SWIZZLE_COLUMNS // K
    return KMajor(
        tile,
        (step // steps_per_block * rows + first_row) * SWIZZLE_BYTES
        + step % steps_per_block * 2 * K,
    )


@always_inline
def mn_slice[rows: Int](tile: SharedMemory, step: Int) -> MNMajor[rows]:
    """The MN-major slice of k-step `step` (rows 16 step ..) of a tile."""
    return MNMajor[rows](tile, step * K * SWIZZLE_BYTES)


@always_inline
def _joined[
    n: Int, lanes: Int
](frags: Frags[DType.float32, 4, n // 8, lanes]) -> SIMD[DType.float32, n // 2]:
    """A thread's accumulator fragments as the instruction's one operand."""
    var out = SIMD[DType.float32, n // 2](0)
    comptime for i in range(n // 8):
        comptime for e in range(4):
            out[4 * i + e] = frags[i, 0][e]
    return out


@always_inline
def _split[
    n: Int, lanes: Int
](values: SIMD[DType.float32, n // 2], mut frags: Frags[DType.float32, 4, n // 8, lanes]):
    comptime for i in range(n // 8):
        frags[i, 0] = values.slice[4, offset=4 * i]()


@always_inline
def wgmma_ss[
    n: Int, lanes: Int, a_lbo: Int, a_sbo: Int, b_major: Bool, b_lbo: Int, b_sbo: Int
](
    a: SharedOperand[True, a_lbo, a_sbo],
    b: SharedOperand[b_major, b_lbo, b_sbo],
    mut d: Frags[DType.float32, 4, n // 8, lanes],
    warp: Int,
):
    """`wgmma.mma_async.m64nNk16.f32.bf16.bf16` with A and B in shared memory:
    D += A B; `warp` is the program's warp within its warpgroup."""
    check_lanes[lanes]()
    comptime if lanes == 1:
        comptime if is_nvidia_gpu["sm_90a"]():
            var acc = wgmma_async[
                WARPGROUP_ROWS,
                n,
                K,
                DType.float32,
                n // 2,
                a_type=DType.bfloat16,
                b_type=DType.bfloat16,
                layout_b="col" if b_major else "row",
            ](a.descriptor(), b.advanced_descriptor(), _joined[n](d))
            _split[n](acc, d)
        else:
            abort(NOT_HOPPER)
    else:
        _emulated_wgmma[n, lanes, False](a, Array[FragA, lanes](fill=0), b, d, warp)


@always_inline
def wgmma_rs[
    n: Int, lanes: Int, b_major: Bool, b_lbo: Int, b_sbo: Int
](
    a: Array[FragA, lanes],
    b: SharedOperand[b_major, b_lbo, b_sbo],
    mut d: Frags[DType.float32, 4, n // 8, lanes],
):
    """`wgmma.mma_async.m64nNk16.f32.bf16.bf16` with A in registers (each
    warp's rows as an `mma.sync` A fragment) and B in shared memory."""
    check_lanes[lanes]()
    comptime if lanes == 1:
        comptime if is_nvidia_gpu["sm_90a"]():
            var acc = wgmma_async[
                WARPGROUP_ROWS,
                n,
                K,
                a_type=DType.bfloat16,
                b_type=DType.bfloat16,
                layout_b="col" if b_major else "row",
            ](a[0], b.advanced_descriptor(), _joined[n](d))
            _split[n](acc, d)
        else:
            abort(NOT_HOPPER)
    else:
        _emulated_wgmma[n, lanes, True](KMajor(b.tile, 0), a, b, d, 0)


@no_inline
def _emulated_wgmma[
    n: Int,
    lanes: Int,
    a_in_registers: Bool,
    a_lbo: Int,
    a_sbo: Int,
    b_major: Bool,
    b_lbo: Int,
    b_sbo: Int,
](
    a_shared: SharedOperand[True, a_lbo, a_sbo],
    a_registers: Array[FragA, lanes],
    b: SharedOperand[b_major, b_lbo, b_sbo],
    mut d: Frags[DType.float32, 4, n // 8, lanes],
    warp: Int,
):
    """One warp's rows of a warpgroup product, A from the lanes' fragments
    (`mma.sync`'s A layout) or from shared memory (rows 16 `warp` ..):
    each D element from its row of A and its column of B."""
    for l in range(lanes):
        var g = l // 4
        var t = l % 4
        for i in range(n // 8):
            var c = d[i, l]
            for e in range(4):
                var row = g + 8 * (e // 2)
                var col = 8 * i + 2 * t + e % 2
                var total = c[e]
                for k in range(K):
                    var a_value: Float32
                    comptime if a_in_registers:
                        var lane = 4 * (row % 8) + k % 8 // 2
                        a_value = a_registers[lane][2 * (row // 8) + 4 * (k // 8) + k % 2].cast[
                            DType.float32
                        ]()
                    else:
                        a_value = a_shared.element(k, 16 * warp + row)
                    total += a_value * b.element(k, col)
                c[e] = total
            d[i, l] = c


@always_inline
def warpgroup_arrive():
    """`wgmma.fence`: the registers the next products read are written."""
    comptime if is_nvidia_gpu["sm_90a"]():
        wgmma_fence_aligned()


@always_inline
def warpgroup_commit():
    """`wgmma.commit_group`: the products issued since the last commit are
    one group, which `warpgroup_wait_groups` counts (none: an empty group)."""
    comptime if is_nvidia_gpu["sm_90a"]():
        wgmma_commit_group_sync()


@always_inline
def warpgroup_wait_groups[pending: Int]():
    """Waits until at most the `pending` newest committed groups are in
    flight: the older groups' results may be read after it, and their
    operands written. The emulator's products are done as they are issued."""
    comptime if is_nvidia_gpu["sm_90a"]():
        wgmma_wait_group_sync[pending]()


@always_inline
def warpgroup_wait():
    """Commits the products issued since the last wait and waits for them:
    their results may be read after it."""
    warpgroup_commit()
    warpgroup_wait_groups[0]()


@always_inline
def async_proxy_fence():
    """`fence.proxy.async.shared::cta`: this thread's writes to shared memory
    (stores, landed `cp.async` copies) are visible to the products issued
    after the next barrier."""
    comptime if is_nvidia_gpu["sm_90a"]():
        fence_async_view_proxy()


@always_inline
def set_warpgroup_registers[count: Int, increase: Bool]():
    """`setmaxnreg`: every thread of this warpgroup holds `count` registers
    from here on, more (`increase`) or fewer than it held, so that
    warpgroups doing different work (a producer's copies, a consumer's
    products) share the multiprocessor's registers unevenly. Every warp of
    the warpgroup runs it; the emulator has no register limit."""
    comptime assert count % 8 == 0 and 24 <= count <= 256, "setmaxnreg takes 24..256 in steps of 8"
    comptime if is_nvidia_gpu["sm_90a"]():
        comptime kind = "inc" if increase else "dec"
        inlined_assembly[
            "setmaxnreg." + kind + ".sync.aligned.u32 " + String(count) + ";",
            NoneType,
            constraints="~{memory}",
            has_side_effect=True,
        ]()
