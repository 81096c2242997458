"""Checks `SharedOperand.advanced_descriptor` (a tile's descriptor advanced
by a slice's start) against `SharedOperand.descriptor`
(`WGMMADescriptor.create` of the slice's own address) bit for bit, for
every slice the `wgmma` prefills take and every 1024-byte-aligned tile
address whose tile fits Hopper's 227 KB of shared memory: prints one line
per operand kind, `<kind> ok` or the first tile, step and both descriptors
that differ (`tests/gpu/test_wgmma_descriptors.py`)."""

from mokv_kernels.gpu.shared_memory import SharedMemory
from mokv_kernels.gpu.swizzle import SWIZZLE_ALIGNMENT
from mokv_kernels.gpu.warpgroup import K, SharedOperand, k_slice, mn_slice
from mokv_kernels.pointers import BytePtr

comptime SHARED_BYTES = 227 * 1024
"""Shared memory a Hopper block may take (`cudaDevAttrMaxSharedMemoryPerBlockOptin`)."""
comptime DEPTH = 128
"""Head dims of the widest tile (128): its K-major slices' steps."""


def tile_at(address: Int) -> SharedMemory:
    """A tile at shared-memory address `address` (never read)."""
    return SharedMemory(BytePtr(unsafe_from_address=address), UInt32(address))


def tiles_of(rows: Int) -> Int:
    """Aligned addresses a `[rows, DEPTH]` tile may start at."""
    return (SHARED_BYTES - rows * DEPTH * 2) // SWIZZLE_ALIGNMENT + 1


def mismatch[
    k_major: Bool, lbo: Int, sbo: Int
](slice: SharedOperand[k_major, lbo, sbo], step: Int) -> String:
    """Empty where both descriptors of a slice agree, else where and how
    they differ."""
    var advanced = slice.advanced_descriptor().desc
    var made = slice.descriptor().desc
    if advanced == made:
        return ""
    return String(t"tile {slice.tile.address} step {step}: {hex(advanced)} != {hex(made)}")


def check_k_major(rows: Int, first_row: Int) -> String:
    for t in range(tiles_of(rows)):
        var tile = tile_at(t * SWIZZLE_ALIGNMENT)
        for step in range(DEPTH // K):
            var differs = mismatch(k_slice(tile, rows, step, first_row), step)
            if differs:
                return differs
    return "ok"


def check_mn_major[rows: Int]() -> String:
    for t in range(tiles_of(rows)):
        var tile = tile_at(t * SWIZZLE_ALIGNMENT)
        for step in range(rows // K):
            var differs = mismatch(mn_slice[rows](tile, step), step)
            if differs:
                return differs
    return "ok"


def main():
    print("keys 64", check_k_major(64, 0))
    print("keys 128", check_k_major(128, 0))
    print("K-major 128 from row 64", check_k_major(128, 64))
    print("values 64", check_mn_major[64]())
    print("values 128", check_mn_major[128]())
