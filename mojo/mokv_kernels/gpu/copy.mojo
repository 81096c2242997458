"""Copies of 4 to 16 bytes from global into shared memory that run
asynchronously where the GPU has them (NVIDIA's `cp.async`, from sm_80) and
complete at once elsewhere (other GPUs, the CPU emulator): a thread starts
its copies, commits them as a group, and later waits for all but its newest
groups, computing meanwhile without holding registers for the data in
flight."""

from max.gpu.memory import async_copy_commit_group, async_copy_wait_group
from std.memory import AddressSpace
from std.sys import size_of
from std.sys._assembly import inlined_assembly
from std.sys.info import is_nvidia_gpu

from ..pointers import CachePtr
from .shared_memory import SharedMemory


@always_inline
def start_copy[
    bytes: Int, dtype: DType
](source: CachePtr[dtype], shared: SharedMemory, offset: Int):
    """Starts copying the `bytes` (4, 8 or 16) at `source` (global memory)
    to `offset` bytes into the block's `shared` memory; both aligned to
    `bytes`. On NVIDIA the copy addresses its destination as the shared
    memory's own address plus `offset`: given a generic pointer (MAX's
    `async_copy`), LLVM converts it from the shared address it had and
    truncates it back, which ptxas kept on every copy of the tile loops
    (the shared window read again and three more instructions)."""
    comptime assert bytes == 4 or bytes == 8 or bytes == 16, "cp.async copies 4, 8 or 16 bytes"
    comptime if is_nvidia_gpu():
        # .cg (L2 only) takes 16 bytes; .ca the smaller copies.
        comptime level = "cg" if bytes == 16 else "ca"
        inlined_assembly[
            "cp.async." + level + ".shared.global [$0], [$1], " + String(bytes) + ";",
            NoneType,
            constraints="r,l,~{memory}",
        ](shared.address + UInt32(offset), source.unsafe_address_space_cast[AddressSpace.GLOBAL]())
    else:
        comptime width = bytes // size_of[Scalar[dtype]]()
        shared.generic.unsafe_offset(offset).unsafe_bitcast[Scalar[dtype]]().unsafe_store[
            alignment=bytes
        ](0, source.unsafe_load[width=width, alignment=bytes](0))


@always_inline
def start_copy_or_zeros[
    dtype: DType
](source: CachePtr[dtype], shared: SharedMemory, offset: Int, present: Bool):
    """`start_copy` of 16 bytes where `present`, else 16 zero bytes written
    there (`source` not read): on NVIDIA one copy either way, whose source
    size is 16 or 0 bytes (`cp.async`'s zero fill, CUTLASS's `ZFILL` copy),
    where a copy and a store of zeros each under its own predicate took
    both, and the addresses of both, in every tile loop that copies."""
    comptime if is_nvidia_gpu():
        inlined_assembly[
            "cp.async.cg.shared.global [$0], [$1], 16, $2;",
            NoneType,
            constraints="r,l,r,~{memory}",
        ](
            shared.address + UInt32(offset),
            source.unsafe_address_space_cast[AddressSpace.GLOBAL](),
            UInt32(16) if present else UInt32(0),
        )
    else:
        if present:
            start_copy[16](source, shared, offset)
        else:
            zero_16(shared.generic.unsafe_offset(offset).unsafe_bitcast[Scalar[dtype]]())


@always_inline
def zero_16[dtype: DType](dest: CachePtr[dtype]):
    """Writes 16 bytes of zeros at `dest` (16-byte aligned)."""
    comptime width = 16 // size_of[Scalar[dtype]]()
    dest.unsafe_store[alignment=16](0, SIMD[dtype, width](0))


@always_inline
def commit_copies():
    """Closes the group of copies this thread started since the last commit."""
    async_copy_commit_group()


@always_inline
def wait_copies[pending: Int]():
    """Waits until at most `pending` of this thread's newest groups are
    still in flight."""
    async_copy_wait_group(Int32(pending))
