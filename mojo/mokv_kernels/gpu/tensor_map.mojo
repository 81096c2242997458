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
tile's keys that lie in one page, and of one row, for the rest.

Under the CPU emulator a box is copied at once, row by row from the cache's
own rows, into shared memory swizzled by the destination's offset bits as
the PTX ISA describes the 128-byte swizzle (16-byte chunk bits 4-6 XOR line
bits 7-9), not by the kernels' own address function, so a kernel whose
boxes and products disagree fails its emulated tests."""

from max.gpu.host import DeviceBuffer, DeviceContext
from max.gpu.host.nvidia.tma import TMADescriptor, TensorMapSwizzle, create_tma_descriptor
from std.sys import size_of
from std.sys._assembly import inlined_assembly
from std.os import abort
from std.sys.info import is_gpu, is_nvidia_gpu
from std.utils import IndexList

from ..cache.traits import KVCacheT
from .copy import SharedMemory, zero_16
from .mbarrier import SharedBarrier
from .warpgroup import SWIZZLE_BYTES, SWIZZLE_COLUMNS

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
struct PageMaps(TrivialRegisterPassable):
    """Where a cache's tensor maps lie in device memory (`MAPS_BYTES`, chunk
    boxes then row boxes), or 0 under the emulator, which needs none."""

    var address: Int

    @staticmethod
    def none() -> Self:
        return Self(0)


def describe_pages[
    cache_t: KVCacheT
](ctx: DeviceContext, k_cache: cache_t, v_cache: cache_t) raises -> Array[TMADescriptor, 2]:
    """The host's tensor maps of one layer's cache (`k_cache`, with
    `v_cache` the same layer's values): chunk boxes, then row boxes. The
    driver refuses a tensor it cannot map (a base or stride that is no
    multiple of 16 bytes), and this raises its error."""
    comptime assert cache_t.dtype == DType.bfloat16, "tensor maps copy bfloat16 rows"
    var heads = k_cache.num_heads()
    var d = k_cache.head_dim()
    if d % SWIZZLE_COLUMNS != 0:
        raise Error(t"head_dim {d}: boxes are whole {SWIZZLE_COLUMNS}-column blocks")
    var base = k_cache.row_in_page(0, 0)
    var value_offset = (Int(v_cache.row_in_page(0, 0)) - Int(base)) // size_of[BFloat16]()
    if value_offset <= 0:
        raise Error(t"the value rows lie {value_offset} elements from the key rows, expected after")
    var pages = k_cache.num_pages()
    var elements = max(pages, 1) * k_cache.page_stride()
    var tensor = DeviceBuffer[DType.bfloat16](
        ctx, base.unsafe_bitcast[BFloat16](), elements, owning=False
    )
    var shape = IndexList[BOX_DIMS](max(pages, 1), 2, k_cache.page_len(), heads, d)
    var strides = IndexList[BOX_DIMS](k_cache.page_stride(), value_offset, heads * d, d, 1)
    comptime swizzled = TensorMapSwizzle.SWIZZLE_128B
    var maps: Array[TMADescriptor, 2] = [
        create_tma_descriptor[DType.bfloat16, BOX_DIMS, swizzled](
            tensor, shape, strides, IndexList[BOX_DIMS](1, 1, CHUNK_ROWS, 1, SWIZZLE_COLUMNS)
        ),
        create_tma_descriptor[DType.bfloat16, BOX_DIMS, swizzled](
            tensor, shape, strides, IndexList[BOX_DIMS](1, 1, 1, 1, SWIZZLE_COLUMNS)
        ),
    ]
    return maps^


@always_inline
def start_box[
    cache_t: KVCacheT, //, rows: Int
](
    maps: PageMaps,
    cache: cache_t,
    shared: SharedMemory,
    offset: Int,
    barrier: SharedBarrier,
    column: Int,
    head: Int,
    kind: Int,
    token: Int,
    page: Int32,
):
    """Starts copying rows `token ..` of `page`, head `head`, columns
    `column ..` of the key (`kind` 0) or value (1) rows, `rows` of them
    (`CHUNK_ROWS` or 1), to `offset` bytes into shared memory (128-byte
    aligned, where the swizzle pattern's row is the box row's); the copy
    counts its `rows * SWIZZLE_BYTES` off `barrier`'s transaction count as
    it lands. `cache` is the one of `kind` (read only by the emulator)."""
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
            shared.address + UInt32(offset),
            UInt64(map),
            Int32(column),
            Int32(head),
            Int32(token),
            Int32(kind),
            page,
            barrier.shared.address + UInt32(barrier.offset),
        )
    elif is_gpu():
        abort("tensor-map copies exist only on NVIDIA Hopper GPUs (Launcher.warpgroup_mma)")
    else:
        _emulated_box[rows](cache, shared, offset, column, head, token, page)
        barrier.complete_bytes(rows * SWIZZLE_BYTES)


def _emulated_box[
    cache_t: KVCacheT, //, rows: Int
](
    cache: cache_t,
    shared: SharedMemory,
    offset: Int,
    column: Int,
    head: Int,
    token: Int,
    page: Int32,
):
    """The emulator's box: each row's 16-byte chunks from the cache's row,
    or zeros outside the tensor, at the chunk the 128-byte swizzle puts
    them (chunk bits 4-6 of the offset XOR its bits 7-9)."""
    for r in range(rows):
        var row = token + r
        var inside = (
            page >= 0
            and Int(page) < cache.num_pages()
            and row >= 0
            and row < cache.page_len()
            and head < cache.num_heads()
        )
        for chunk in range(SWIZZLE_BYTES // 16):
            var byte = offset + r * SWIZZLE_BYTES + chunk * 16
            var dest = shared.generic.unsafe_offset(byte ^ (byte >> 7 & 7) << 4)
            var target = dest.unsafe_bitcast[Scalar[cache_t.dtype]]()
            if inside:
                comptime width = 16 // size_of[Scalar[cache_t.dtype]]()
                var source = cache.row_in_page(Int(page), row).unsafe_offset(
                    head * cache.head_dim() + column + chunk * width
                )
                target.unsafe_store[alignment=16](0, source.unsafe_load[width=width](0))
            else:
                zero_16(target)
