"""How mokv's GPU kernels are written, launched and emulated.

A kernel (`KernelT`) is a grid of thread blocks. Each block runs a
`schedule`: a sequence of phases, each executed by every thread of the block
(`ThreadProgram.step`), with `sync` (a block barrier) between phases that
communicate through shared memory. A thread's registers are the fields of its
`ThreadProgram`.

That split lets one kernel body run two ways:

- on a GPU (`GpuLauncher`): one `ThreadProgram` per hardware thread, `sync`
  is `barrier()`, shared memory is the block's dynamic shared memory;
- on the CPU (`Emulator`), with no GPU at all: every block of the grid in
  turn, its threads' programs held in a list and shared memory a host array
  filled with NaN (so a read of a value no phase wrote shows up). Phases
  queued since the last `sync` run thread by thread, highest thread first,
  each thread running all of them before the next thread starts: the
  interleaving a missing barrier allows, so a phase that reads what another
  thread wrote without a `sync` in between reads NaN or stale data. A
  kernel with warp-collective steps (`warp`: tensor-core fragments,
  shuffles) runs there warp by warp instead: one program per warp, holding
  every lane's registers (`KernelT.LANES`).

Warps that do different work and hand it over through barriers of their own
(`mbarrier`: a producer's copies, its consumers' products) mark each hand-off
with `handoff`: nothing on a GPU, where each warp runs its own part of the
schedule (`ONE_THREAD`, `thread`), and on the emulator a point where the
phases queued so far run, so that the emulated barriers check that every
wait finds its phase complete.

The emulator is how the kernels' index arithmetic, masking, splitting and
merging are tested on machines without a GPU; it cannot show timing, warp
behaviour or anything the hardware adds.
"""

from max.gpu import MAX_THREADS_PER_BLOCK_METADATA, barrier, block_idx, thread_idx
from max.gpu.host import DeviceAttribute, DeviceBuffer, DeviceContext, Dim, FuncAttribute
from std.sys._assembly import inlined_assembly
from std.sys.info import is_amd_gpu, is_nvidia_gpu
from std.os import abort
from std.utils.numerics import nan
from std.utils.static_tuple import StaticTuple

from ..pointers import F32Ptr
from .shared_memory import shared_memory
from .tensor_map import MAP_ALIGNMENT, MAPS_BYTES, PageMaps, PageTensor, describe_pages
from .warp import WARP


comptime DEFAULT_SHARED_BYTES = 48 * 1024
"""Dynamic shared memory a launch gets without opting in to more."""
comptime AMD_SHARED_BYTES = 64 * 1024
"""Shared memory (LDS) an AMD MI300 (gfx942) workgroup gets."""
comptime MAX_GRID_YZ = 65535
"""Most blocks of a grid along y and along z (x takes 2^31 - 1)."""


@fieldwise_init
struct BlockId(TrivialRegisterPassable):
    """A thread block's coordinates in its grid."""

    var x: Int
    var y: Int
    var z: Int


trait ThreadProgram(Copyable, Deinitable):
    """One thread of a block: its registers (the fields) and its code for
    each phase of the block's schedule."""

    def step(mut self, phase: Int, arg: Int):
        """Runs phase `phase` (with the schedule's argument `arg`)."""
        ...


trait BlockExecutor:
    """Runs a block's phases on its threads."""

    comptime ONE_THREAD: Bool
    """Whether it runs one thread's program (a GPU thread, `thread` names
    it), or every thread's of the block (the emulator)."""

    def thread(self) -> Int:
        """`ONE_THREAD`: the thread whose program it runs."""
        ...

    def each(mut self, phase: Int, arg: Int):
        """Every thread runs `phase`."""
        ...

    def sync(mut self):
        """Block barrier: every phase before it completes, in every thread,
        before any phase after it starts."""
        ...

    def handoff(mut self):
        """Where warps that do different work pass it on through barriers of
        their own (`..mbarrier`): nothing on a GPU, whose warps then run
        apart; the emulator runs the phases queued so far, as at `sync`,
        so each warp's waits find what the others did before it."""
        ...


trait KernelT(TrivialRegisterPassable):
    """A grid of blocks of `THREADS` threads, all running `schedule`."""

    comptime Program: ThreadProgram
    comptime THREADS: Int
    comptime MIN_BLOCKS: Int
    """Blocks per multiprocessor the compiler must leave registers for
    (it then keeps each thread under 65536 / (THREADS * MIN_BLOCKS)
    registers, spilling if it must): 1 leaves it free to take up to 255."""
    comptime LANES: Int = 1
    """Threads one program stands for: 1, or under the emulator a whole
    warp (`warp.WARP`) for a kernel with warp-collective steps, whose
    registers are then every lane's (`warp`). On a GPU always 1."""
    comptime NAME: StaticString
    """What the kernel is, as `tools/check_gpu_build.sh --registers` reports
    it (with `HEAD_DIM` and `ELEMENT_BITS` when they vary)."""
    comptime HEAD_DIM: Int = 0
    comptime ELEMENT_BITS: Int = 0
    comptime SHARED_BYTES: Int
    """Shared memory per block; at most `AMD_SHARED_BYTES` for a kernel
    that may run on AMD GPUs (checked when compiling for them)."""
    comptime TENSOR_CORES: Bool = False
    """Whether it uses tensor cores (`mma.sync`, `warp`; or `wgmma`,
    `warpgroup`): then it runs only where `Launcher.tensor_cores` (for
    `wgmma`, `Launcher.warpgroup_mma`) says so, never on an AMD GPU."""

    def grid(self) -> BlockId:
        """Blocks along x, y and z."""
        ...

    def program(self, block: BlockId, tid: Int, shared: F32Ptr) -> Self.Program:
        """Thread `tid`'s program in block `block`."""
        ...

    def schedule[E: BlockExecutor](self, mut threads: E, block: BlockId):
        """Block `block`'s phases, in order. Control flow may depend only on
        values that are the same in every thread of the block."""
        ...


struct GpuBlock[P: ThreadProgram](BlockExecutor):
    """The executor inside a GPU thread: it runs its own program. Its
    methods are inlined, and so must be the program's phases (`step` and
    what it calls): a program reached through a call has its address taken
    and lives in local memory, so every access to the thread's state (the
    prefill's output accumulators) becomes a local-memory access.
    `tools/check_gpu_build.sh --registers` shows each kernel's stack."""

    comptime ONE_THREAD = True

    var me: Self.P

    @always_inline
    def __init__(out self, var me: Self.P):
        self.me = me^

    @always_inline
    def thread(self) -> Int:
        return Int(thread_idx.x)

    @always_inline
    def each(mut self, phase: Int, arg: Int):
        self.me.step(phase, arg)

    @always_inline
    def sync(mut self):
        barrier()

    @always_inline
    def handoff(mut self):
        pass


trait Launcher:
    """Where kernels run: a GPU stream (`GpuLauncher`) or the CPU emulator."""

    comptime LANES: Int
    """`KernelT.LANES` of the kernels with warp-collective steps launched
    here: 1 on a GPU, a warp under the emulator."""

    def launch[K: KernelT](mut self, kernel: K) raises:
        """Runs (or enqueues) `kernel`'s whole grid."""
        ...

    def scratch(mut self, floats: Int) raises -> F32Ptr:
        """Float32 scratch memory that lives as long as the launcher."""
        ...

    def multiprocessors(self) -> Int:
        """Blocks that run at once, roughly: what a grid must cover to keep
        the device busy."""
        ...

    def tensor_cores(self) -> Bool:
        """Whether kernels with `mma.sync` steps (`warp`) run here: NVIDIA
        GPUs from sm_80, and the emulator."""
        ...

    def warpgroup_mma(self) -> Bool:
        """Whether kernels with `wgmma` steps (`warpgroup`) run here: NVIDIA
        Hopper GPUs (sm_90), and the emulator."""
        ...

    def page_maps(mut self, tensor: PageTensor) raises -> PageMaps:
        """The tensor maps of a page tensor (`..tensor_map`), in device
        memory that lives as long as the launcher: on a GPU with
        `warpgroup_mma` only; none under the emulator, whose boxes read the
        tensor itself."""
        ...


def _dim(n: Int) raises -> Int:
    if n <= 0 or n > 2**31 - 1:
        raise Error(t"grid dimension {n} is outside 1..2^31-1")
    return n


struct GpuLauncher(Launcher):
    """Enqueues kernels on a `DeviceContext`'s stream. Scratch buffers are
    freed when the launcher is destroyed; the device frees them in stream
    order, after the kernels enqueued before."""

    comptime LANES = 1

    var ctx: DeviceContext
    var buffers: List[DeviceBuffer[DType.float32]]

    def __init__(out self, ctx: DeviceContext):
        self.ctx = ctx
        self.buffers = List[DeviceBuffer[DType.float32]]()

    def launch[K: KernelT](mut self, kernel: K) raises:
        comptime assert K.LANES == 1, "on a GPU a program is one thread"
        var grid = kernel.grid()
        if grid.x == 0 or grid.y == 0 or grid.z == 0:
            return
        if grid.y > MAX_GRID_YZ or grid.z > MAX_GRID_YZ:
            raise Error(
                t"grid {grid.x} x {grid.y} x {grid.z} exceeds {MAX_GRID_YZ} blocks along y or z"
            )
        comptime shared_bytes = K.SHARED_BYTES

        @__llvm_metadata(
            MAX_THREADS_PER_BLOCK_METADATA=StaticTuple[Int32, 1](Int32(K.THREADS)),
            `nvvm.minctasm`=SIMDLength(K.MIN_BLOCKS),
        )
        def run_block() {var kernel}:
            comptime if is_nvidia_gpu():
                # What the kernel is, for tools/ptx_registers.py's report.
                inlined_assembly[
                    "// mokv-kernel "
                    + K.NAME
                    + " head_dim=$0 bits=$1 threads=$2 shared=$3 min_blocks=$4 tensor_cores=$5",
                    NoneType,
                    constraints="n,n,n,n,n,n",
                    has_side_effect=True,
                ](
                    Int32(K.HEAD_DIM),
                    Int32(K.ELEMENT_BITS),
                    Int32(K.THREADS),
                    Int32(K.SHARED_BYTES),
                    Int32(K.MIN_BLOCKS),
                    Int32(1 if K.TENSOR_CORES else 0),
                )
            elif is_amd_gpu() and not K.TENSOR_CORES:
                comptime assert K.SHARED_BYTES <= AMD_SHARED_BYTES, String(
                    "kernel ", K.NAME, " takes more shared memory than an AMD workgroup gets"
                )
            var block = BlockId(Int(block_idx.x), Int(block_idx.y), Int(block_idx.z))
            var threads = GpuBlock(kernel.program(block, Int(thread_idx.x), shared_memory()))
            kernel.schedule(threads, block)

        self.ctx.enqueue_function(
            run_block,
            grid_dim=Dim(_dim(grid.x), grid.y, grid.z),
            block_dim=K.THREADS,
            shared_mem_bytes=shared_bytes,
            func_attribute=FuncAttribute.MAX_DYNAMIC_SHARED_SIZE_BYTES(
                UInt32(max(shared_bytes, DEFAULT_SHARED_BYTES))
            ),
        )

    def scratch(mut self, floats: Int) raises -> F32Ptr:
        self.buffers.append(self.ctx.enqueue_create_buffer[DType.float32](max(floats, 1)))
        return (
            self.buffers[len(self.buffers) - 1]
            .unsafe_ptr()
            .unsafe_origin_cast[MutUntrackedOrigin]()
        )

    def multiprocessors(self) -> Int:
        try:
            return self.ctx.get_attribute(DeviceAttribute.MULTIPROCESSOR_COUNT)
        except:
            return 1

    def tensor_cores(self) -> Bool:
        try:
            return (
                self.ctx.api() == "cuda"
                and self.ctx.get_attribute(DeviceAttribute.COMPUTE_CAPABILITY_MAJOR) >= 8
            )
        except:
            return False

    def warpgroup_mma(self) -> Bool:
        try:
            return (
                self.ctx.api() == "cuda"
                and self.ctx.get_attribute(DeviceAttribute.COMPUTE_CAPABILITY_MAJOR) == 9
            )
        except:
            return False

    def page_maps(mut self, tensor: PageTensor) raises -> PageMaps:
        var maps = describe_pages(self.ctx, tensor)
        # Room to align: the allocator's alignment is not promised.
        var start = self.scratch((MAPS_BYTES + MAP_ALIGNMENT) // 4)
        var skip = -Int(start) % MAP_ALIGNMENT // 4
        # Into the buffer `scratch` kept last; from pageable host memory,
        # staged before the call returns.
        self.ctx.enqueue_copy(
            self.buffers[len(self.buffers) - 1].create_sub_buffer[DType.float32](
                skip, MAPS_BYTES // 4
            ),
            Pointer(to=maps).unsafe_bitcast[Float32](),
        )
        return PageMaps(Int(start) + 4 * skip, tensor)


struct EmulatedBlock[P: ThreadProgram](BlockExecutor):
    """Every thread of one block on the CPU (see the module docstring)."""

    comptime ONE_THREAD = False

    var threads: List[Self.P]
    var pending: List[Tuple[Int, Int]]

    def __init__(out self, var threads: List[Self.P]):
        self.threads = threads^
        self.pending = List[Tuple[Int, Int]]()

    def thread(self) -> Int:
        abort("the emulator runs every thread of a block")
        return -1

    def each(mut self, phase: Int, arg: Int):
        self.pending.append((phase, arg))

    def sync(mut self):
        for t in range(len(self.threads) - 1, -1, -1):
            for i in range(len(self.pending)):
                self.threads[t].step(self.pending[i][0], self.pending[i][1])
        self.pending.clear()

    def handoff(mut self):
        self.sync()


struct Emulator(Launcher):
    """Runs kernels on the CPU, block after block (see the module docstring).
    For tests: slow, and only as exact as the host's float32 arithmetic.
    `has_tensor_cores` false makes the ops pick the kernels they launch on
    GPUs without `mma.sync` (or `wgmma`). `launched` says which kernels ran,
    in order, a line each: `KernelT.NAME`, `KernelT.MIN_BLOCKS` and the
    grid's x, y and z, so tests see which kernels an op chose and how it cut
    the work for them."""

    comptime LANES = WARP

    var scratch_buffers: List[List[Float32]]
    var num_multiprocessors: Int
    var has_tensor_cores: Bool
    var launched: List[String]

    def __init__(out self, num_multiprocessors: Int, has_tensor_cores: Bool = True):
        self.scratch_buffers = List[List[Float32]]()
        self.num_multiprocessors = num_multiprocessors
        self.has_tensor_cores = has_tensor_cores
        self.launched = List[String]()

    def launch[K: KernelT](mut self, kernel: K) raises:
        var grid = kernel.grid()
        self.launched.append(
            String(K.NAME, " ", K.MIN_BLOCKS, " ", grid.x, " ", grid.y, " ", grid.z)
        )
        var shared = List[Float32](length=max(K.SHARED_BYTES // 4, 1), fill=0)
        var shared_ptr = shared.unsafe_ptr().unsafe_origin_cast[MutUntrackedOrigin]()
        for z in range(grid.z):
            for y in range(grid.y):
                for x in range(grid.x):
                    for i in range(len(shared)):
                        shared[i] = nan[DType.float32]()
                    var block = BlockId(x, y, z)
                    var programs = List[K.Program]()
                    for tid in range(0, K.THREADS, K.LANES):
                        programs.append(kernel.program(block, tid, shared_ptr))
                    var threads = EmulatedBlock(programs^)
                    kernel.schedule(threads, block)
                    threads.sync()
        _ = shared^

    def scratch(mut self, floats: Int) raises -> F32Ptr:
        self.scratch_buffers.append(List[Float32](length=max(floats, 1), fill=nan[DType.float32]()))
        return (
            self.scratch_buffers[len(self.scratch_buffers) - 1]
            .unsafe_ptr()
            .unsafe_origin_cast[MutUntrackedOrigin]()
        )

    def multiprocessors(self) -> Int:
        return self.num_multiprocessors

    def tensor_cores(self) -> Bool:
        return self.has_tensor_cores

    def warpgroup_mma(self) -> Bool:
        return self.has_tensor_cores

    def page_maps(mut self, tensor: PageTensor) raises -> PageMaps:
        return PageMaps(0, tensor)
