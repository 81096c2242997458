"""Cache rows copied by Hopper's tensor memory accelerator (TMA): one thread
starts the copy of a box of rows of one page, the copy engine lands it in
shared memory swizzled as `..warpgroup` lays tiles out, and counts its bytes
off a barrier (`..mbarrier`) as they land, where `cp.async` took one
instruction per 16 bytes per thread, and each thread's own wait.

A tensor map describes one layer of a cache as the copy engine sees it: the
page tensor's rows from `row_in_page(0, 0)` of its key cache, five
dimensions, innermost first: head_dim, KV heads, rows of a page (`page_len`),
K or V (`KEYS`, `VALUES`: the value rows lie a fixed distance from the key
rows), pages (`page_stride` apart). A box is `SWIZZLE_COLUMNS` columns of
one head, `rows` rows of one page, K or V: it never crosses a page, and
every element outside the tensor (rows past a page's end, a page index no
page has: a bad table entry, or -1 for rows past a block's keys) lands as
a zero. The maps of a cache (`PageMaps`): boxes of `CHUNK_ROWS` rows, for a
tile's keys that lie in one page, and of one row, for the rest. The host
builds them (`describe_pages`, through the driver) and copies them to device
memory (`..block.Launcher.page_maps`), where a thread must acquire them
(`acquire_maps`) before its first box.

Under the CPU emulator a box is copied row by row from the cache's own rows
and lands when a thread next looks at its barrier (`..mbarrier`), swizzled
by the destination's offset bits as the PTX ISA describes the 128-byte
swizzle (16-byte chunk bits 4-6 XOR line bits 7-9), not by the kernels' own
address function, so a kernel whose boxes and products disagree fails its
emulated tests."""

from max.gpu.host import DeviceBuffer, DeviceContext
from max.gpu.host.nvidia.tma import TMADescriptor, TensorMapSwizzle, create_tma_descriptor
from std.sys import size_of
from std.sys._assembly import inlined_assembly
from std.os import abort
from std.sys.info import is_gpu, is_nvidia_gpu
from std.utils import IndexList

from ..cache.traits import KVCacheT
from ..pointers import BF16Ptr, BytePtr
from .copy import zero_16
from .mbarrier import SharedBarrier
from .swizzle import SWIZZLE_BYTES, SWIZZLE_COLUMNS

comptime CHUNK_ROWS = 16
"""Rows of a chunk box: a quarter of a 64-key tile."""
comptime MAP_BYTES = 128
"""Bytes of a tensor map (the driver's opaque `CUtensorMap`)."""
comptime MAP_ALIGNMENT = 64
"""Where a tensor map must lie in device memory."""
comptime MAPS_BYTES = 2 * MAP_BYTES
"""A cache's two maps: chunk boxes, then row boxes."""
comptime BOX_DIMS = 5


@fieldwise_init
struct PageTensor(TrivialRegisterPassable):
    """One layer's bfloat16 page tensor as the copy engine sees it: from
    the address `base` (row 0 of page 0's key rows), `pages` pages `page_stride`
    elements apart, each `page_len` key rows of `heads * head_dim`, and
    the value rows `value_offset` elements after the key rows."""

    var base: Int
    var pages: Int
    var page_len: Int
    var heads: Int
    var head_dim: Int
    var value_offset: Int
    var page_stride: Int

    @staticmethod
    def of[cache_t: KVCacheT](k_cache: cache_t, v_cache: cache_t) -> Self:
        """The page tensor of one layer's cache (`k_cache`, with `v_cache`
        the same layer's values)."""
        comptime assert cache_t.dtype == DType.bfloat16, "tensor maps copy bfloat16 rows"
        var base = k_cache.row_in_page(0, 0)
        return Self(
            Int(base),
            k_cache.num_pages(),
            k_cache.page_len(),
            k_cache.num_heads(),
            k_cache.head_dim(),
            (Int(v_cache.row_in_page(0, 0)) - Int(base)) // size_of[BFloat16](),
            k_cache.page_stride(),
        )

    def holds(self, page: Int32, row: Int, head: Int) -> Bool:
        """Whether row `row` of `page`, head `head`, is in the tensor."""
        return (
            page >= 0
            and Int(page) < self.pages
            and row >= 0
            and row < self.page_len
            and head >= 0
            and head < self.heads
        )

    def row(self, kind: Int, page: Int32, row: Int, head: Int) -> BF16Ptr:
        """Head `head` of key (`kind` 0) or value (1) row `row` of `page`."""
        return BF16Ptr(unsafe_from_address=self.base).unsafe_offset(
            Int(page) * self.page_stride
            + kind * self.value_offset
            + (row * self.heads + head) * self.head_dim
        )


@fieldwise_init
struct PageMaps(TrivialRegisterPassable):
    """A cache's tensor maps: where they lie in device memory (`MAPS_BYTES`,
    chunk boxes then row boxes), 0 under the emulator, which copies boxes
    from `tensor` itself."""

    var address: Int
    var tensor: PageTensor

    @staticmethod
    def none() -> Self:
        """No maps: for kernels that copy no boxes."""
        return Self(0, PageTensor(0, 0, 0, 0, 0, 0, 0))


def describe_pages(ctx: DeviceContext, tensor: PageTensor) raises -> Array[TMADescriptor, 2]:
    """The host's tensor maps of `tensor`: chunk boxes, then row boxes. The
    driver refuses a tensor it cannot map (a base or stride that is no
    multiple of 16 bytes), and this raises its error."""
    if tensor.head_dim % SWIZZLE_COLUMNS != 0:
        raise Error(t"head_dim {tensor.head_dim}: boxes are whole {SWIZZLE_COLUMNS}-column blocks")
    if tensor.value_offset <= 0:
        raise Error(
            t"the value rows lie {tensor.value_offset} elements from the key rows, expected after"
        )
    var pages = max(tensor.pages, 1)
    var buffer = DeviceBuffer[DType.bfloat16](
        ctx, BF16Ptr(unsafe_from_address=tensor.base), pages * tensor.page_stride, owning=False
    )
    var shape = IndexList[BOX_DIMS](pages, 2, tensor.page_len, tensor.heads, tensor.head_dim)
    var strides = IndexList[BOX_DIMS](
        tensor.page_stride, tensor.value_offset, tensor.heads * tensor.head_dim, tensor.head_dim, 1
    )
    comptime swizzled = TensorMapSwizzle.SWIZZLE_128B
    var maps: Array[TMADescriptor, 2] = [
        create_tma_descriptor[DType.bfloat16, BOX_DIMS, swizzled](
            buffer, shape, strides, IndexList[BOX_DIMS](1, 1, CHUNK_ROWS, 1, SWIZZLE_COLUMNS)
        ),
        create_tma_descriptor[DType.bfloat16, BOX_DIMS, swizzled](
            buffer, shape, strides, IndexList[BOX_DIMS](1, 1, 1, 1, SWIZZLE_COLUMNS)
        ),
    ]
    return maps^


@always_inline
def acquire_maps(maps: PageMaps):
    """Before a thread's first box: the maps, written to device memory by a
    host copy, acquired by the tensor-map proxy (`fence.proxy.tensormap`
    at system scope, as CUDA's programming guide asks of a map copied so);
    nothing under the emulator."""
    comptime if is_nvidia_gpu():
        comptime for map in range(MAPS_BYTES // MAP_BYTES):
            inlined_assembly[
                "fence.proxy.tensormap::generic.acquire.sys [$0], 128;",
                NoneType,
                constraints="l,~{memory}",
                has_side_effect=True,
            ](UInt64(maps.address + map * MAP_BYTES))


@always_inline
def start_box[
    rows: Int
](
    maps: PageMaps,
    offset: Int,
    barrier: SharedBarrier,
    column: Int,
    head: Int,
    kind: Int,
    row: Int,
    page: Int32,
):
    """Starts copying rows `row ..` of `page`, head `head`, columns
    `column ..` of the key (`kind` 0) or value (1) rows, `rows` of them
    (`CHUNK_ROWS` or 1), to `offset` bytes into the shared memory that
    holds `barrier` (128-byte aligned, where the swizzle pattern's row is
    the box row's); the copy
    counts its `rows * SWIZZLE_BYTES` off `barrier`'s transaction count as
    it lands, zeros outside the tensor included."""
    comptime assert rows == CHUNK_ROWS or rows == 1, "a map has boxes of CHUNK_ROWS rows or of one"
    comptime if is_nvidia_gpu():
        var map = maps.address + (0 if rows == CHUNK_ROWS else MAP_BYTES)
        inlined_assembly[
            "cp.async.bulk.tensor.5d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
            + " [$0], [$1, {$2, $3, $4, $5, $6}], [$7];",
            NoneType,
            constraints="r,l,r,r,r,r,r,r,~{memory}",
            has_side_effect=True,
        ](
            barrier.shared.address + UInt32(offset),
            UInt64(map),
            Int32(column),
            Int32(head),
            Int32(row),
            Int32(kind),
            page,
            barrier.shared.address + UInt32(barrier.offset),
        )
    elif is_gpu():
        abort("tensor-map copies exist only on NVIDIA Hopper GPUs (Launcher.warpgroup_mma)")
    else:
        var data = barrier.pending_copy(offset, rows * SWIZZLE_BYTES)
        _emulated_box[rows](maps.tensor, data, offset, column, head, kind, row, page)


def _emulated_box[
    rows: Int
](
    tensor: PageTensor,
    data: BytePtr,
    offset: Int,
    column: Int,
    head: Int,
    kind: Int,
    row: Int,
    page: Int32,
):
    """The emulator's box, as it will land at `offset` bytes into shared
    memory (`data`, the barrier's pending copy): each row's 16-byte chunks
    from the tensor, or zeros outside it, at the chunk the 128-byte swizzle
    puts them (chunk bits 4-6 of the destination XOR its bits 7-9, which
    keeps each row in its own 128-byte line)."""
    for r in range(rows):
        var inside = tensor.holds(page, row + r, head)
        for chunk in range(SWIZZLE_BYTES // 16):
            var byte = offset + r * SWIZZLE_BYTES + chunk * 16
            var target = data.unsafe_offset((byte ^ (byte >> 7 & 7) << 4) - offset).unsafe_bitcast[
                BFloat16
            ]()
            if inside:
                var source = tensor.row(kind, page, row + r, head).unsafe_offset(column + 8 * chunk)
                target.unsafe_store[alignment=16](0, source.unsafe_load[width=8](0))
            else:
                zero_16(target)
