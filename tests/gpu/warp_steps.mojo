"""The `warp` op of the test harnesses: which step a call names, dispatched
the same way whether the emulator (`emulator.mojo`, a program per warp) or
the GPU (`warp_steps_on_gpu.mojo`, a program per thread) runs it, and the
warpgroup product a `wgmma` call describes."""

from mokv_kernels.gpu.shared_memory import SharedMemory
from mokv_kernels.gpu.mbarrier import SharedBarrier
from mokv_kernels.gpu.swizzle import SWIZZLE_BYTES
from mokv_kernels.gpu.tensor_map import CHUNK_ROWS, PageMaps, PageTensor, start_box
from mokv_kernels.gpu.warp import FragA, Frags
from mokv_kernels.gpu.warpgroup import k_slice, mn_slice, wgmma_rs, wgmma_ss

from call_files import Call

comptime WGMMA_TILE_ROWS = 64
"""Rows of the swizzled `[64, 128]` tiles a `wgmma` step reads (`a_tile`,
`b_tile`, laid out by the test)."""
comptime BOX_FIELDS = 7
"""A `box` step's box: rows (16 or 1), shared-memory offset, column, head,
K or V, row, page (int32 each)."""


trait WarpSteps:
    """Runs each step on a call's files and writes the lanes' results to
    its `out.bin`."""

    def mma(mut self, call: Call) raises:
        ...

    def shuffle_xor(mut self, call: Call) raises:
        ...

    def ld_matrix[count: Int, transpose: Bool](mut self, call: Call) raises:
        ...

    def wgmma[n: Int](mut self, call: Call) raises:
        ...

    def mbarrier(mut self, call: Call) raises:
        """A barrier of `count` arrivals: `first` lanes arrive, then
        `second`; every lane writes whether the phases of parity 0 and 1
        are complete (`uint32` 1 or 0 each)."""
        ...

    def box(mut self, call: Call) raises:
        """Tensor-map boxes (`mokv_kernels.gpu.tensor_map`) of the page
        tensor `tensor` (bfloat16 `[pages, 2, page_len, heads, head_dim]`)
        into `shared_bytes` of shared memory first filled with 0xFF bytes,
        completing a barrier that expects their bytes (`boxes`: int32
        `[n, BOX_FIELDS]`); writes the shared memory, then `uint32` 1 if
        the barrier's phase completed (0 if it had not after a long wait)."""
        ...


def run_warp_step[S: WarpSteps](mut steps: S, call: Call) raises:
    """The step `call` names (`step`, with `count` and `transpose` for
    `ld_matrix`, `n` for `wgmma`)."""
    var step = call.text("step")
    if step == "mma":
        steps.mma(call)
    elif step == "shuffle_xor":
        steps.shuffle_xor(call)
    elif step == "ld_matrix":
        var count = call.int("count")
        var transpose = call.int("transpose") == 1
        comptime for c in range(3):
            comptime n = 1 << c
            if count == n:
                if transpose:
                    steps.ld_matrix[n, True](call)
                else:
                    steps.ld_matrix[n, False](call)
    elif step == "mbarrier":
        steps.mbarrier(call)
    elif step == "box":
        steps.box(call)
    elif step == "wgmma":
        var n = call.int("n")
        if n == 64:
            steps.wgmma[64](call)
        elif n == 128:
            steps.wgmma[128](call)
        else:
            raise Error(t"wgmma with N {n}: the tests use 64 or 128")
    else:
        raise Error(t"unknown warp step {step}")


@always_inline
def wgmma_product[
    n: Int, lanes: Int
](
    a_tile: SharedMemory,
    b_tile: SharedMemory,
    a: Array[FragA, lanes],
    mut d: Frags[DType.float32, 4, n // 8, lanes],
    a_shared: Bool,
    k_major: Bool,
    step: Int,
    warp: Int,
):
    """D += A B for a `wgmma` call: A from `a_tile` (K-major, k-step `step`;
    `warp` is the program's warp in its warpgroup) when `a_shared`, else
    the lanes' fragments `a`; B from `b_tile`, K-major or MN-major, at
    k-step `step`."""
    if a_shared and k_major:
        wgmma_ss[n](
            k_slice(a_tile, WGMMA_TILE_ROWS, step), k_slice(b_tile, WGMMA_TILE_ROWS, step), d, warp
        )
    elif a_shared:
        wgmma_ss[n](
            k_slice(a_tile, WGMMA_TILE_ROWS, step),
            mn_slice[WGMMA_TILE_ROWS](b_tile, step),
            d,
            warp,
        )
    elif k_major:
        wgmma_rs[n](a, k_slice(b_tile, WGMMA_TILE_ROWS, step), d)
    else:
        wgmma_rs[n](a, mn_slice[WGMMA_TILE_ROWS](b_tile, step), d)


def box_tensor(call: Call, base: Int) raises -> PageTensor:
    """The page tensor of a `box` call whose elements start at `base`: key
    rows, then value rows, in every page."""
    var heads = call.int("heads")
    var head_dim = call.int("head_dim")
    var page_len = call.int("page_len")
    var rows = page_len * heads * head_dim
    return PageTensor(base, call.int("pages"), page_len, heads, head_dim, rows, 2 * rows)


@always_inline
def start_boxes(
    maps: PageMaps,
    barrier: SharedBarrier,
    boxes: Pointer[Int32, MutUntrackedOrigin],
    count: Int,
):
    """Starts a `box` call's `count` boxes, after arriving on `barrier`
    expecting all their bytes."""
    var bytes = 0
    for b in range(count):
        bytes += Int(boxes[unsafe_offset=b * BOX_FIELDS]) * SWIZZLE_BYTES
    barrier.arrive_expecting(bytes)
    for b in range(count):
        var box = boxes.unsafe_offset(b * BOX_FIELDS)
        var offset = Int(box[unsafe_offset=1])
        var column = Int(box[unsafe_offset=2])
        var head = Int(box[unsafe_offset=3])
        var kind = Int(box[unsafe_offset=4])
        var row = Int(box[unsafe_offset=5])
        var page = box[unsafe_offset=6]
        if box[unsafe_offset=0] == CHUNK_ROWS:
            start_box[CHUNK_ROWS](maps, offset, barrier, column, head, kind, row, page)
        else:
            start_box[1](maps, offset, barrier, column, head, kind, row, page)
