"""Op-tensor views over raw memory, with every dimension known only at run
time (as a graph with symbolic dimensions hands them to an op): how the GPU
compile check and the CPU emulator call the same entry points as the ops."""

from extensibility import IOSpec, ManagedTensorSlice
from extensibility.managed_tensor_slice import StaticTensorSpec, _IndexListToTileLayout
from std.memory import AddressSpace
from std.sys import align_of
from std.utils import IndexList

comptime _unknown[rank: Int] = IndexList[rank](fill=-1)
comptime _spec[dtype: DType, rank: Int] = StaticTensorSpec[
    dtype, rank, static_layout=_IndexListToTileLayout[_unknown[rank], _unknown[rank]]
](align_of[dtype](), AddressSpace.GENERIC)

comptime InputView[dtype: DType, rank: Int] = ManagedTensorSlice[
    io_spec=IOSpec.Input, static_spec=_spec[dtype, rank]
]
comptime MutableView[dtype: DType, rank: Int] = ManagedTensorSlice[
    io_spec=IOSpec.MutableInput, static_spec=_spec[dtype, rank]
]
comptime OutputView[dtype: DType, rank: Int] = ManagedTensorSlice[
    io_spec=IOSpec.Output, static_spec=_spec[dtype, rank]
]


def row_major[rank: Int](shape: IndexList[rank]) -> IndexList[rank]:
    """Strides of a contiguous row-major tensor of `shape`."""
    var strides = IndexList[rank](fill=1)
    for i in range(rank - 2, -1, -1):
        strides[i] = strides[i + 1] * shape[i + 1]
    return strides
