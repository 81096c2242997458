"""Runs one warp step of `tests/gpu/emulator.mojo`'s `warp` op on the GPU
instead (`warp_steps`): the very call files (`call_files`), the same result in `out.bin`,
but each lane a hardware thread calling the step with `lanes` 1, as the
kernels do. `tests/gpu/test_warp_emulation.py` runs its cases both ways, so
on a GPU the emulated steps are checked against the hardware itself, not
only against the PTX ISA as read here.

Steps `mma`, `ld_matrix`, `shuffle_xor`, `mbarrier` and `box` run on one warp; `wgmma` on a
warpgroup of four, every warp given the same lanes' inputs, warp `warp`'s
result written (on a GPU without warpgroup MMA the step aborts). Shared
memory is loaded from the call's arrays by the threads, then fenced for the
asynchronous proxy, as the kernels do.
"""

from max.gpu import barrier, thread_idx
from max.gpu.host import DeviceBuffer, DeviceContext
from max.gpu.memory import external_memory
from std.memory import AddressSpace
from std.sys import argv, size_of

from mokv_kernels.pointers import BF16Ptr, CachePtr
from mokv_kernels.gpu.shared_memory import SharedMemory, shared_memory
from mokv_kernels.gpu.block import GpuLauncher
from mokv_kernels.gpu.mbarrier import BARRIER_BYTES, SharedBarrier
from mokv_kernels.gpu.warp import (
    WARP,
    FragA,
    FragB,
    FragC,
    Frags,
    ld_matrix,
    mma,
    shuffle_xor,
    warp_barrier,
)
from mokv_kernels.gpu.tensor_map import acquire_maps
from mokv_kernels.gpu.swizzle import SWIZZLE_ALIGNMENT
from mokv_kernels.gpu.warpgroup import async_proxy_fence, warpgroup_arrive, warpgroup_wait

from call_files import Call
from warp_steps import (
    WGMMA_TILE_ROWS,
    WarpSteps,
    box_tensor,
    run_warp_step,
    start_boxes,
    wgmma_product,
)

comptime TILE = WGMMA_TILE_ROWS * 128
"""Elements of each `[64, 128]` tile a `wgmma` step reads."""


def _device[dtype: DType](ctx: DeviceContext, mut bytes: List[UInt8]) raises -> DeviceBuffer[dtype]:
    """`bytes` copied to a new device buffer of `dtype` elements."""
    var buffer = ctx.enqueue_create_buffer[dtype](max(len(bytes) // size_of[Scalar[dtype]](), 1))
    if len(bytes):
        ctx.enqueue_copy(buffer, bytes.unsafe_ptr().unsafe_bitcast[Scalar[dtype]]())
    return buffer


def _input[
    dtype: DType
](ctx: DeviceContext, call: Call, name: String) raises -> DeviceBuffer[dtype]:
    var bytes = call.read(name)
    return _device[dtype](ctx, bytes)


def _ptr[dtype: DType](mut buffer: DeviceBuffer[dtype]) -> CachePtr[dtype]:
    return buffer.unsafe_ptr().unsafe_origin_cast[MutUntrackedOrigin]()


def _shared_bf16() -> BF16Ptr:
    return (
        external_memory[BFloat16, address_space=AddressSpace.SHARED, alignment=SWIZZLE_ALIGNMENT]()
        .unsafe_address_space_cast[AddressSpace.GENERIC]()
        .unsafe_origin_cast[MutUntrackedOrigin]()
    )


def _fill_shared(to: BF16Ptr, source: CachePtr[DType.bfloat16], count: Int, threads: Int):
    """Every thread copies its share of `count` elements into shared memory,
    then makes them visible to warpgroup products after the barrier."""
    for i in range(Int(thread_idx.x), count, threads):
        to[unsafe_offset=i] = source[unsafe_offset=i]
    async_proxy_fence()
    barrier()


def _write_out[
    dtype: DType
](ctx: DeviceContext, call: Call, result: DeviceBuffer[dtype], count: Int) raises:
    """The device buffer `result` (`count` elements) as the call's `out.bin`."""
    var bytes = List[UInt8](length=count * size_of[Scalar[dtype]](), fill=0)
    ctx.enqueue_copy(bytes.unsafe_ptr().unsafe_bitcast[Scalar[dtype]](), result)
    ctx.synchronize()
    call.write("out", bytes)


def _mma[dtype: DType](ctx: DeviceContext, call: Call) raises:
    """The `mma` step with operands of `dtype` (bits in bfloat16 registers)."""
    var a_buffer = _input[DType.bfloat16](ctx, call, "a")
    var b_buffer = _input[DType.bfloat16](ctx, call, "b")
    var c_buffer = _input[DType.float32](ctx, call, "c")
    var a = _ptr(a_buffer)
    var b = _ptr(b_buffer)
    var c = _ptr(c_buffer)
    var out = ctx.enqueue_create_buffer[DType.float32](WARP * 4)
    var d = _ptr(out)

    def run() {var a, var b, var c, var d}:
        var lane = Int(thread_idx.x)
        var result = mma[1, dtype](
            Array[FragA, 1](fill=a.unsafe_load[width=8](8 * lane)),
            Array[FragB, 1](fill=b.unsafe_load[width=4](4 * lane)),
            Array[FragC, 1](fill=c.unsafe_load[width=4](4 * lane)),
        )
        d.unsafe_store(4 * lane, result[0])

    ctx.enqueue_function(run, grid_dim=1, block_dim=WARP)
    _write_out(ctx, call, out, WARP * 4)
    _ = a_buffer^
    _ = b_buffer^
    _ = c_buffer^


def _shuffle_xor(ctx: DeviceContext, call: Call) raises:
    var values_buffer = _input[DType.float32](ctx, call, "values")
    var values = _ptr(values_buffer)
    var out = ctx.enqueue_create_buffer[DType.float32](WARP)
    var d = _ptr(out)
    var mask = Int32(call.int("mask"))  # a kernel argument: a fixed-width integer

    def run() {var values, var d, var mask}:
        var lane = Int(thread_idx.x)
        d[unsafe_offset=lane] = shuffle_xor[1](
            Array[Float32, 1](fill=values[unsafe_offset=lane]), Int(mask)
        )[0]

    ctx.enqueue_function(run, grid_dim=1, block_dim=WARP)
    _write_out(ctx, call, out, WARP)
    _ = values_buffer^


def _ld_matrix[count: Int, transpose: Bool](ctx: DeviceContext, call: Call) raises:
    comptime SMEM = 64 * 8
    var smem_buffer = _input[DType.bfloat16](ctx, call, "smem")
    var rows_buffer = _input[DType.uint32](ctx, call, "rows")
    var smem = _ptr(smem_buffer)
    var rows = _ptr(rows_buffer)
    var out = ctx.enqueue_create_buffer[DType.bfloat16](WARP * 2 * count)
    var d = _ptr(out)

    def run() {var smem, var rows, var d}:
        var lane = Int(thread_idx.x)
        var shared = _shared_bf16()
        _fill_shared(shared, smem, SMEM, WARP)
        var row = shared.unsafe_offset(Int(rows[unsafe_offset=lane]) * 8)
        var result = ld_matrix[count, transpose, 1](Array[BF16Ptr, 1](fill=row))
        d.unsafe_store(2 * count * lane, result[0])

    ctx.enqueue_function(run, grid_dim=1, block_dim=WARP, shared_mem_bytes=SMEM * 2)
    _write_out(ctx, call, out, WARP * 2 * count)
    _ = smem_buffer^
    _ = rows_buffer^


def _wgmma[n: Int](ctx: DeviceContext, call: Call) raises:
    var a_shared = call.int("a_shared") == 1
    var a_tile_buffer = _input[DType.bfloat16](ctx, call, "a_tile")
    var b_tile_buffer = _input[DType.bfloat16](ctx, call, "b_tile")
    var c_buffer = _input[DType.float32](ctx, call, "c")
    var a_buffer = ctx.enqueue_create_buffer[DType.bfloat16](WARP * 8)
    if not a_shared:
        a_buffer = _input[DType.bfloat16](ctx, call, "a")
    var a_tile = _ptr(a_tile_buffer)
    var b_tile = _ptr(b_tile_buffer)
    var c = _ptr(c_buffer)
    var a = _ptr(a_buffer)
    var out = ctx.enqueue_create_buffer[DType.float32](WARP * n // 2)
    var d = _ptr(out)
    var k_major = call.int("b_major") == 1
    var step = Int32(call.int("k_step"))  # kernel arguments: fixed-width integers
    var warp = Int32(call.int("warp"))

    def run() {
        var a_tile, var b_tile, var c, var a, var d, var a_shared, var k_major, var step, var warp
    }:
        var lane = Int(thread_idx.x) % WARP
        var shared = _shared_bf16()
        _fill_shared(shared, a_tile, TILE, 4 * WARP)
        _fill_shared(shared.unsafe_offset(TILE), b_tile, TILE, 4 * WARP)
        var acc = Frags[DType.float32, 4, n // 8, 1](0)
        comptime for i in range(n // 8):
            acc[i, 0] = c.unsafe_load[width=4](lane * n // 2 + 4 * i)
        var fragment = Array[FragA, 1](fill=a.unsafe_load[width=8](8 * lane))
        var tiles = SharedMemory.of(shared.unsafe_bitcast[UInt8]())
        warpgroup_arrive()
        wgmma_product[n](
            tiles, tiles.at(2 * TILE), fragment, acc, a_shared, k_major, Int(step), 0
        )
        warpgroup_wait()
        if Int(thread_idx.x) // WARP == Int(warp):
            comptime for i in range(n // 8):
                d.unsafe_store(lane * n // 2 + 4 * i, acc[i, 0])

    ctx.enqueue_function(run, grid_dim=1, block_dim=4 * WARP, shared_mem_bytes=2 * TILE * 2)
    _write_out(ctx, call, out, WARP * n // 2)
    _ = a_tile_buffer^
    _ = b_tile_buffer^
    _ = c_buffer^
    _ = a_buffer^


def _mbarrier(ctx: DeviceContext, call: Call) raises:
    var out = ctx.enqueue_create_buffer[DType.uint32](2 * WARP)
    var d = _ptr(out)
    # Kernel arguments: fixed-width integers.
    var count = Int32(call.int("count"))
    var first = Int32(call.int("first"))
    var second = Int32(call.int("second"))

    def run() {var d, var count, var first, var second}:
        var lane = Int(thread_idx.x)
        var phases = SharedBarrier(SharedMemory.of(shared_memory().unsafe_bitcast[UInt8]()), 0)
        if lane == 0:
            phases.init(Int(count))
        barrier()
        if lane < Int(first):
            phases.arrive[1]()
        warp_barrier[1]()
        if lane < Int(second):
            phases.arrive[1]()
        warp_barrier[1]()
        d[unsafe_offset=2 * lane] = UInt32(1 if phases.is_complete(0) else 0)
        d[unsafe_offset=2 * lane + 1] = UInt32(1 if phases.is_complete(1) else 0)

    ctx.enqueue_function(run, grid_dim=1, block_dim=WARP, shared_mem_bytes=BARRIER_BYTES)
    _write_out(ctx, call, out, 2 * WARP)


comptime BOX_POLLS = 1 << 22
"""`box`: how often a lane probes the barrier before it reports the phase
incomplete (a box whose bytes are never counted would otherwise hang)."""


def _box(ctx: DeviceContext, call: Call) raises:
    var tensor_buffer = _input[DType.bfloat16](ctx, call, "tensor")
    var boxes_buffer = _input[DType.int32](ctx, call, "boxes")
    var shared_bytes = call.int("shared_bytes")
    var launcher = GpuLauncher(ctx)
    var maps = launcher.page_maps(box_tensor(call, Int(tensor_buffer.unsafe_ptr())))
    var out = ctx.enqueue_create_buffer[DType.uint32](shared_bytes // 4 + 1)
    var d = _ptr(out)
    var boxes = _ptr(boxes_buffer)
    # Kernel arguments: fixed-width integers.
    var count = Int32(call.int("count"))
    var words = Int32(shared_bytes // 4)

    def run() {var d, var boxes, var count, var words, var maps}:
        var lane = Int(thread_idx.x)
        var shared = SharedMemory.of(shared_memory().unsafe_bitcast[UInt8]())
        var landed = SharedBarrier(shared, 4 * Int(words))
        var smem = shared.generic.unsafe_bitcast[UInt32]()
        for i in range(lane, Int(words), WARP):
            smem[unsafe_offset=i] = 0xFFFFFFFF
        if lane == 0:
            landed.init(1)
            landed.fence_init()
        async_proxy_fence()
        barrier()
        if lane == 0:
            acquire_maps(maps)
            start_boxes(maps, landed, boxes, Int(count))
        var done = False
        for _ in range(BOX_POLLS):
            if landed.is_complete(0):
                done = True
                break
        barrier()
        for i in range(lane, Int(words), WARP):
            d[unsafe_offset=i] = smem[unsafe_offset=i]
        if lane == 0:
            d[unsafe_offset=Int(words)] = UInt32(1 if done else 0)

    ctx.enqueue_function(
        run, grid_dim=1, block_dim=WARP, shared_mem_bytes=shared_bytes + BARRIER_BYTES
    )
    _write_out(ctx, call, out, shared_bytes // 4 + 1)
    _ = tensor_buffer^
    _ = boxes_buffer^
    _ = launcher^


struct GpuSteps(WarpSteps):
    """The `warp` op's steps on the device of `ctx`."""

    var ctx: DeviceContext

    def __init__(out self) raises:
        self.ctx = DeviceContext()

    def mma(mut self, call: Call) raises:
        if call.int("float16") != 0:
            _mma[DType.float16](self.ctx, call)
        else:
            _mma[DType.bfloat16](self.ctx, call)

    def shuffle_xor(mut self, call: Call) raises:
        _shuffle_xor(self.ctx, call)

    def ld_matrix[count: Int, transpose: Bool](mut self, call: Call) raises:
        _ld_matrix[count, transpose](self.ctx, call)

    def wgmma[n: Int](mut self, call: Call) raises:
        _wgmma[n](self.ctx, call)

    def mbarrier(mut self, call: Call) raises:
        _mbarrier(self.ctx, call)

    def box(mut self, call: Call) raises:
        _box(self.ctx, call)


def main() raises:
    var steps = GpuSteps()
    run_warp_step(steps, Call(String(argv()[1])))
