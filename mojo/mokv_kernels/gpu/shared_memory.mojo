"""The block's dynamic shared memory: the generic pointer its threads read
it through, and on NVIDIA its own 32-bit address, which `cp.async` copies
(`.copy`), `wgmma` descriptors (`.warpgroup`) and barriers (`.mbarrier`)
take. It starts where a swizzled tile may (`.swizzle`)."""

from max.gpu.memory import external_memory
from std.memory import AddressSpace
from std.sys.info import is_nvidia_gpu

from ..pointers import BytePtr, F32Ptr
from .swizzle import SWIZZLE_ALIGNMENT


@always_inline
def _dynamic_shared() -> Pointer[Float32, MutUntrackedOrigin, address_space=AddressSpace.SHARED]:
    """The block's dynamic shared memory, in its own address space."""
    return external_memory[
        Float32, address_space=AddressSpace.SHARED, alignment=SWIZZLE_ALIGNMENT
    ]().unsafe_origin_cast[MutUntrackedOrigin]()


@always_inline
def shared_memory() -> F32Ptr:
    """The block's dynamic shared memory as a generic pointer, the one
    kernels take (`.block`); `.copy.start_copy` addresses it by offsets."""
    return _dynamic_shared().unsafe_address_space_cast[AddressSpace.GENERIC]()


@fieldwise_init
struct SharedMemory(TrivialRegisterPassable):
    """The block's shared memory, or a part of it from some byte on (`at`),
    as `.copy.start_copy` and `wgmma` descriptors take it: the generic pointer
    threads read it through (`shared_memory`), and on NVIDIA its own 32-bit
    address, found once per block (0 elsewhere)."""

    var generic: BytePtr
    var address: UInt32

    @staticmethod
    @always_inline
    def of(generic: BytePtr) -> Self:
        """`generic`, the start of `shared_memory`, with its address."""
        var address: UInt32 = 0
        comptime if is_nvidia_gpu():
            address = UInt32(Int(_dynamic_shared()))
        return Self(generic, address)

    @always_inline
    def at(self, offset: Int) -> Self:
        """The shared memory from `offset` bytes on, both ways."""
        return Self(self.generic.unsafe_offset(offset), self.address + UInt32(offset))
