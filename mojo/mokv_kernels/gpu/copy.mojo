"""Copies of 4 to 16 bytes from global into shared memory that run
asynchronously where the GPU has them (NVIDIA's `cp.async`, from sm_80) and
complete at once elsewhere (other GPUs, the CPU emulator): a thread starts
its copies, commits them as a group, and later waits for all but its newest
groups, computing meanwhile without holding registers for the data in
flight."""

from max.gpu.memory import async_copy, async_copy_commit_group, async_copy_wait_group
from std.memory import AddressSpace
from std.sys import size_of
from std.sys.info import is_nvidia_gpu

from ..pointers import CachePtr


@always_inline
def start_copy[bytes: Int, dtype: DType](source: CachePtr[dtype], dest: CachePtr[dtype]):
    """Starts copying the `bytes` (4, 8 or 16) at `source` (global memory)
    to `dest` (shared memory); both aligned to `bytes`."""
    comptime assert bytes == 4 or bytes == 8 or bytes == 16, "cp.async copies 4, 8 or 16 bytes"
    comptime width = bytes // size_of[Scalar[dtype]]()
    comptime if is_nvidia_gpu():
        async_copy[bytes](
            source.unsafe_address_space_cast[AddressSpace.GLOBAL](),
            dest.unsafe_address_space_cast[AddressSpace.SHARED](),
        )
    else:
        dest.unsafe_store[alignment=bytes](0, source.unsafe_load[width=width, alignment=bytes](0))


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
