"""The 128-byte swizzle every tensor-core tile is stored in: a tile
`[rows, D]` of bfloat16 is D / 64 column blocks `[rows, 64]` of 128-byte
rows, the 16-byte chunk c of row r at chunk `c ^ (r % 8)`, each block
starting 1024-byte aligned. The eight rows one `ldmatrix` reads sit in
distinct banks; a `wgmma` reads the tile through a descriptor
(`.warpgroup`), and a tensor-map box lands in it (`.tensor_map`). Kept
apart from both so that the shared memory's own alignment
(`.shared_memory`) needs neither."""

comptime SWIZZLE_BYTES = 128
"""Bytes of a swizzled row: 64 bfloat16 columns."""
comptime SWIZZLE_COLUMNS = 64
comptime SWIZZLE_ALIGNMENT = 1024
"""Where a swizzled tile must start: the 8 rows the pattern repeats over."""


def swizzled[rows: Int](row: Int, chunk: Int) -> Int:
    """Element offset of chunk `chunk` (8 elements) of row `row` in a
    swizzled bfloat16 tile of `rows` rows."""
    comptime chunks = SWIZZLE_COLUMNS // 8
    return (chunk // chunks * rows + row) * SWIZZLE_COLUMNS + (chunk % chunks ^ row % 8) * 8
