"""Context tokens visited tile by tile, reading pages in place.

Both kinds of work item (decode and prefill) share this tile loop
(`TileWalk`): it holds the K and V row pointers of the current tile of
`TILE` context tokens, looked up through the page table one contiguous run
at a time, and already those of the next tile, for prefetching; for a
quantized cache, also each row's scales.
"""

from std.sys import prefetch, size_of

from ..cache.traits import KVCacheT
from ..pointers import CachePtr, ScalePtr
from ..kv_quantization import is_quantized
from .config import TILE


comptime RowPtrs[dtype: DType] = Array[CachePtr[dtype], TILE]
comptime ScaleRows = Array[ScalePtr, TILE]
comptime RowBlock[dtype: DType, size: Int] = Array[CachePtr[dtype], size]


def _offset_rows[
    dtype: DType, size: Int
](rows: RowBlock[dtype, size], offset: Int) -> RowBlock[dtype, size]:
    """The same rows, each `offset` elements on: one head's segment of each."""
    var out = RowBlock[dtype, size](fill=rows[0])
    comptime for t in range(size):
        out[t] = rows[t].unsafe_offset(offset)
    return out^


def _tile_rows[
    cache_t: KVCacheT
](
    cache: cache_t,
    row: Int,
    start: Int,
    count: Int,
    rows: Pointer[CachePtr[cache_t.dtype], MutUntrackedOrigin],
    scales: Pointer[ScalePtr, MutUntrackedOrigin],
):
    """Writes pointers to the token rows `start ..< start + count` of batch
    row `row` to `rows`, one page lookup per contiguous run, and for a
    quantized cache pointers to their scales to `scales`."""
    var row_elems = cache.num_heads() * cache.head_dim()
    var j = 0
    while j < count:
        var run = min(count - j, cache.contiguous_tokens(start + j))
        var p = cache.row_ptr(row, start + j)
        for i in range(run):
            rows[unsafe_offset=j + i] = p.unsafe_offset(i * row_elems)
        comptime if is_quantized[cache_t.dtype]():
            # Scale rows follow one another within a page too: one lookup per run.
            var table = cache.scales()
            var scale_row = cache.scale_row(row, start + j)
            var stride = cache.num_heads() * table.granules
            var in_scale_block = (start + j) % table.tokens_per_scale
            for i in range(run):
                scales[unsafe_offset=j + i] = scale_row
                in_scale_block += 1
                if in_scale_block == table.tokens_per_scale:
                    in_scale_block = 0
                    scale_row = scale_row.unsafe_offset(stride)
        j += run


struct TileWalk[cache_t: KVCacheT]:
    """Walks context positions `start ..< end` of batch row `row` tile by
    tile, holding the K and V row pointers of the current tile (`pos`, `n`)
    and already those of the next (`next_n` rows).

    A prefill item reads one head's segment of each row: pieces a row apart
    (4 KB for 8 heads of 128 floats) that the hardware prefetcher does not
    follow, so the item prefetches the next tile's segments with
    `prefetch_next`, a row at a time spread over its compute (issued all at
    once, the prefetches themselves stall on the line fill buffers).
    Decode items read whole rows in blocks of a few, and prefetch the rows a
    fixed distance ahead (`k_ahead`, `v_ahead`) as they go: a block ahead is
    too close to hide the memory latency."""

    var k_cache: Self.cache_t
    var v_cache: Self.cache_t
    var row: Int
    var end: Int
    var pos: Int
    var n: Int
    var next_n: Int
    var k_rows: RowPtrs[Self.cache_t.dtype]
    var v_rows: RowPtrs[Self.cache_t.dtype]
    var next_k: RowPtrs[Self.cache_t.dtype]
    var next_v: RowPtrs[Self.cache_t.dtype]
    var k_scales: ScaleRows
    var v_scales: ScaleRows
    var next_k_scales: ScaleRows
    var next_v_scales: ScaleRows

    def __init__(
        out self,
        k_cache: Self.cache_t,
        v_cache: Self.cache_t,
        row: Int,
        start: Int,
        end: Int,
    ):
        self.k_cache = k_cache
        self.v_cache = v_cache
        self.row = row
        self.end = end
        self.pos = start
        self.n = 0
        self.next_n = 0
        var any_row = k_cache.row_ptr(row, start)
        self.k_rows = RowPtrs[Self.cache_t.dtype](fill=any_row)
        self.v_rows = RowPtrs[Self.cache_t.dtype](fill=any_row)
        self.next_k = RowPtrs[Self.cache_t.dtype](fill=any_row)
        self.next_v = RowPtrs[Self.cache_t.dtype](fill=any_row)
        var any_scales = k_cache.scale_row(row, start)  # never read when unquantized
        self.k_scales = ScaleRows(fill=any_scales)
        self.v_scales = ScaleRows(fill=any_scales)
        self.next_k_scales = ScaleRows(fill=any_scales)
        self.next_v_scales = ScaleRows(fill=any_scales)
        self._fetch(start)

    def _fetch(mut self, start: Int):
        """Looks up the rows of the tile at `start`, if any."""
        self.next_n = max(0, min(TILE, self.end - start))
        if self.next_n > 0:
            _tile_rows(
                self.k_cache,
                self.row,
                start,
                self.next_n,
                self.next_k.unsafe_ptr().unsafe_origin_cast[MutUntrackedOrigin](),
                self.next_k_scales.unsafe_ptr().unsafe_origin_cast[MutUntrackedOrigin](),
            )
            _tile_rows(
                self.v_cache,
                self.row,
                start,
                self.next_n,
                self.next_v.unsafe_ptr().unsafe_origin_cast[MutUntrackedOrigin](),
                self.next_v_scales.unsafe_ptr().unsafe_origin_cast[MutUntrackedOrigin](),
            )

    def prefetch_next(self, j: Int, start: Int, length: Int):
        """Prefetches elements `start ..< start + length` of the K and V rows
        `j` of the next tile, if it has one."""
        if j >= self.next_n:
            return
        comptime line = 64 // size_of[Scalar[Self.cache_t.dtype]]()
        var k = self.next_k[j].unsafe_offset(start)
        var v = self.next_v[j].unsafe_offset(start)
        for i in range(0, length, line):
            prefetch(k.unsafe_offset(i))
            prefetch(v.unsafe_offset(i))

    def k_row(self, j: Int) -> CachePtr[Self.cache_t.dtype]:
        """Key row `j < TILE` of the current tile, unchecked: a checked index
        makes LLVM keep an abort path's arguments alive in the hot loop."""
        return self.k_rows.unsafe_ptr()[unsafe_offset=j]

    def v_row(self, j: Int) -> CachePtr[Self.cache_t.dtype]:
        """Value row `j < TILE` of the current tile, unchecked."""
        return self.v_rows.unsafe_ptr()[unsafe_offset=j]

    def k_scale(self, j: Int) -> ScalePtr:
        """The scales of key row `j < TILE` of the current tile (quantized)."""
        return self.k_scales.unsafe_ptr()[unsafe_offset=j]

    def v_scale(self, j: Int) -> ScalePtr:
        """The scales of value row `j < TILE` of the current tile (quantized)."""
        return self.v_scales.unsafe_ptr()[unsafe_offset=j]

    def k_ahead(self, j: Int) -> CachePtr[Self.cache_t.dtype]:
        """Key row `j` counted from the current tile's start, reaching into
        the next tile (the last row once past both): a prefetch target."""
        if j < self.n:
            return self.k_row(j)
        if j - self.n < self.next_n:
            return self.next_k.unsafe_ptr()[unsafe_offset=j - self.n]
        return self.k_row(self.n - 1)

    def v_ahead(self, j: Int) -> CachePtr[Self.cache_t.dtype]:
        """Value row `j` as `k_ahead` finds key rows."""
        if j < self.n:
            return self.v_row(j)
        if j - self.n < self.next_n:
            return self.next_v.unsafe_ptr()[unsafe_offset=j - self.n]
        return self.v_row(self.n - 1)

    def advance(mut self) -> Bool:
        """Moves to the next tile; False once the context is exhausted."""
        self.pos += self.n
        if self.pos >= self.end:
            return False
        self.n = min(TILE, self.end - self.pos)
        self.k_rows = self.next_k.copy()
        self.v_rows = self.next_v.copy()
        for j in range(self.n, TILE):  # blocks may run past a partial tile's end
            self.k_rows[j] = self.k_rows[self.n - 1]
            self.v_rows[j] = self.v_rows[self.n - 1]
        comptime if is_quantized[Self.cache_t.dtype]():
            self.k_scales = self.next_k_scales.copy()
            self.v_scales = self.next_v_scales.copy()
            for j in range(self.n, TILE):
                self.k_scales[j] = self.k_scales[self.n - 1]
                self.v_scales[j] = self.v_scales[self.n - 1]
        self._fetch(self.pos + self.n)
        return True
