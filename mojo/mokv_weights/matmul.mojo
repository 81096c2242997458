"""`y = x @ w.T` for float32 `x [M, K]` and `w [N, K]` in planar rows of GGUF
blocks (`blocks.mojo`), the weights dequantized as they are read: in registers
for one row of `x`, a few rows at a time into a cache-sized panel for several.

The arithmetic is float32 throughout on exactly the weights the float32
format holds, so the two formats differ only in the order of the sums. That
matters more than speed here: quantizing the activations too (int8, as
llama.cpp and MAX's `qmatmul` do; bfloat16 likewise) makes every product
discontinuous in its input, so the last-bit differences between two attention
kernels (paged and dense) flip roundings, the flips grow from layer to layer,
and the two graphs' greedy tokens part wherever the top two logits are close.

Several rows of `x`: register blocks (`_tile`) of rows of `x` by rows of `w`,
each product accumulated in its own vector and summed across lanes once per
output. Up to `DIRECT_MR` rows of `x` fit one block, which dequantizes each
weight in registers as it goes; for more, each parallel item first dequantizes
its rows of `w` into a float32 panel (`_dequantize_rows`), once for all the
blocks of rows of `x` that read it.

One row of `x` (decode at batch 1) nothing reuses, so `_row_dot` applies each
block's scale once, to the block's partial product, instead of to each
weight: `w . x = sum_b d_b (q_b . x_b) + m_b sum(x_b)`, the second sum over
the row's minimums and `x`'s block sums (`_block_sums`, once per call). That is
a multiply-add per 32 weights instead of two. It reads one weight row at a
time: a single stream the hardware prefetcher follows across pages, where
four rows read side by side (four streams a row apart) ran slower.
"""

import extensibility
from extensibility import InputTensor, OutputTensor
from max.gpu.host import DeviceContext
from max.gpu.host.info import is_cpu
from std.math import ceildiv
from std.memory.alloc import unsafe_alloc
from std.sys import prefetch, size_of
from std.sys.info import CompilationTarget

from .blocks import (
    BLOCK_VALUES,
    GROUP,
    GROUPS,
    BlockRow,
    BlockScales,
    Group,
    block_bytes,
    code_bytes,
)
from .parallel import Job, run_items
from .pointers import BytePtr, F32Ptr

comptime DIRECT_MR = 8 if CompilationTarget.has_avx512f() else 6
"""Rows of `x` up to which a product dequantizes each weight in registers, in register
blocks of all its rows by `DIRECT_NR` rows of `w`: the accumulators, the weights, `x` and
the blocks' scales a register each (32 vector registers with AVX-512, 16 without)."""
comptime DIRECT_NR = 2
comptime PANEL_MR = 8 if CompilationTarget.has_avx512f() else 4
"""Rows of `x` per register block over an item's dequantized panel (more than `DIRECT_MR`
rows of `x`): `PANEL_MR * PANEL_NR` accumulators, `PANEL_NR` weight vectors and one of `x`.
On AVX2, 4 x 3 beat 6 x 2 (fewer loads per multiply-add; 16 rows in 4 blocks)."""
comptime PANEL_NR = 2 if CompilationTarget.has_avx512f() else 3
comptime PREFETCH_AHEAD = 4096
"""Bytes ahead of the weight rows being read that the products prefetch: a decode step
streams all the weights from memory, and the hardware prefetcher stops at every 4 KB
page. One page ahead was the best of the distances tried."""
comptime BLOCKS_PER_ITEM = 4096
"""Block products per parallel item, at least: enough work that taking an item costs
little beside it; a product of fewer runs on the calling thread alone."""
comptime PANEL_ROWS = 12 * PANEL_NR
"""Rows of `w` an item dequantizes into its panel at least: each block of `PANEL_MR` rows of
`x` then meets 12 register blocks while it is in cache (faster than items of 4 rows of
`w`)."""
comptime SCALE_RUN = 16
"""Blocks whose scales `_row_dot` converts at once (one float16 vector)."""


def _dequantize_rows[
    encoding: StaticString
](w: BytePtr, w_stride: Int, rows: Int, k: Int, panel: F32Ptr):
    """Rows `0 ..< rows` of `w` as float32 `[rows, k]` in `panel`: once for all rows of
    `x`, where dequantizing inside the register blocks would repeat it for every block of
    rows of `x` (and, on AVX2, spill accumulators to make room for the scales)."""
    var blocks = k // BLOCK_VALUES
    for c in range(rows):
        var row = BlockRow[encoding](w.unsafe_offset(c * w_stride), blocks)
        var out = panel.unsafe_offset(c * k)
        for b in range(blocks):
            # The rows' bytes are contiguous: this walks them, `PREFETCH_AHEAD` ahead.
            prefetch(w.unsafe_offset(c * w_stride + PREFETCH_AHEAD + b * code_bytes[encoding]()))
            var scales = row.scales(b)
            comptime for g in range(GROUPS):
                out.unsafe_store(b * BLOCK_VALUES + g * GROUP, row.dequantize[g](b, scales))


@always_inline
def _tile[
    encoding: StaticString, R: Int, C: Int, FROM_PANEL: Bool
](x: F32Ptr, k: Int, w: BytePtr, w_stride: Int, y: F32Ptr, y_stride: Int):
    """`y[R, C] = x[R, k] @ w[C, k].T`, the rows of `w` `w_stride` bytes apart: blocks of
    `encoding` dequantized here, or (`FROM_PANEL`) float32 weights. A block of fewer than 8
    outputs gives each several accumulators (`CHAINS`), so that enough FMAs are in flight."""
    comptime CHAINS = 1 if R * C >= 8 else 8 // (R * C)
    var blocks = k // BLOCK_VALUES
    var rows = Array[BlockRow[encoding], C](uninitialized=True)
    comptime if not FROM_PANEL:
        comptime for c in range(C):
            rows[c] = BlockRow[encoding](w.unsafe_offset(c * w_stride), blocks)
    var acc = Array[Group, R * C * CHAINS](fill=0)
    for b in range(blocks):
        var scales = Array[BlockScales, C](fill=BlockScales(Group(0), Group(0)))
        comptime if not FROM_PANEL:
            # The `C` rows' bytes are contiguous: this walks them, `PREFETCH_AHEAD` ahead.
            prefetch(w.unsafe_offset(PREFETCH_AHEAD + b * C * block_bytes[encoding]()))
            comptime for c in range(C):
                scales[c] = rows[c].scales(b)
        comptime for g in range(GROUPS):
            var at = b * BLOCK_VALUES + g * GROUP
            var weights = Array[Group, C](fill=0)
            comptime for c in range(C):
                comptime if FROM_PANEL:
                    var row = w.unsafe_offset(c * w_stride).unsafe_bitcast[Float32]()
                    weights[c] = row.unsafe_load[width=GROUP](at)
                else:
                    weights[c] = rows[c].dequantize[g](b, scales[c])
            comptime for r in range(R):
                var xv = x.unsafe_load[width=GROUP](r * k + at)
                comptime for c in range(C):
                    comptime i = (r * C + c) * CHAINS + g % CHAINS
                    acc[i] = weights[c].fma(xv, acc[i])
    comptime for r in range(R):
        comptime for c in range(C):
            var total = acc[(r * C + c) * CHAINS]
            comptime for chain in range(1, CHAINS):
                total += acc[(r * C + c) * CHAINS + chain]
            y[unsafe_offset=r * y_stride + c] = total.reduce_add()


@always_inline
def _tile_of[
    encoding: StaticString, MR: Int, C: Int, FROM_PANEL: Bool
](rows: Int, x: F32Ptr, k: Int, w: BytePtr, w_stride: Int, y: F32Ptr, y_stride: Int):
    """`_tile` for `rows <= MR` rows of `x`, known only at run time."""
    comptime for r in range(1, MR + 1):
        if rows == r:
            _tile[encoding, r, C, FROM_PANEL](x, k, w, w_stride, y, y_stride)


@no_inline
def _tiles[
    encoding: StaticString, MR: Int, NR: Int, FROM_PANEL: Bool
](rows: Int, x: F32Ptr, k: Int, w: BytePtr, w_stride: Int, n_rows: Int, y: F32Ptr, y_stride: Int):
    """`y[rows, n_rows] = x[rows, k] @ w[n_rows, k].T` for `rows <= MR`, in register blocks
    of `NR` rows of `w` and a last one of fewer. A function of its own: inlined into an
    item's `run` beside the other kind of block, the direct blocks ran slower at a few
    rows of `x`."""
    for n in range(0, n_rows, NR):
        var wp = w.unsafe_offset(n * w_stride)
        var yp = y.unsafe_offset(n)
        if n_rows - n >= NR:
            _tile_of[encoding, MR, NR, FROM_PANEL](rows, x, k, wp, w_stride, yp, y_stride)
        else:
            comptime for c in range(1, NR):
                if n_rows - n == c:
                    _tile_of[encoding, MR, c, FROM_PANEL](rows, x, k, wp, w_stride, yp, y_stride)


@always_inline
def _row_dot[
    encoding: StaticString
](x: F32Ptr, x_sums: F32Ptr, k: Int, row: BlockRow[encoding]) -> Float32:
    """`x[1, k] . row` for one row of `x` (a decode step at batch 1), each block's scale
    applied to its partial product; `x_sums[b]` is the sum of `x`'s block `b` (read for
    q4_1's minimums). Two blocks per iteration into their own accumulators."""
    var blocks = k // BLOCK_VALUES
    var acc = Array[Group, 2](fill=0)
    var offsets = SIMD[DType.float32, SCALE_RUN](0)
    var scales = Array[Float32, SCALE_RUN](fill=0)
    var scale_at = F32Ptr(unsafe_from_address=Int(scales.unsafe_ptr()))
    var first = 0
    while first < blocks:
        var run = min(SCALE_RUN, blocks - first)
        if run == SCALE_RUN:
            scale_at.unsafe_store(
                0, row.d.unsafe_load[width=SCALE_RUN](first).cast[DType.float32]()
            )
            comptime if encoding == "q4_1":
                var m = row.m.unsafe_load[width=SCALE_RUN](first).cast[DType.float32]()
                offsets = m.fma(x_sums.unsafe_load[width=SCALE_RUN](first), offsets)
        else:
            for j in range(run):
                scale_at[unsafe_offset=j] = row.d[unsafe_offset=first + j].cast[DType.float32]()
                comptime if encoding == "q4_1":
                    offsets[0] = (
                        row.m[unsafe_offset=first + j]
                        .cast[DType.float32]()
                        .fma(x_sums[unsafe_offset=first + j], offsets[0])
                    )
        var j = 0
        while j < run:
            # The rows after this one, ahead of the hardware prefetcher, which stops at pages.
            prefetch(
                row.codes_plane.unsafe_offset(
                    PREFETCH_AHEAD + (first + j) * block_bytes[encoding]()
                )
            )
            comptime for u in range(2):
                # An odd run's last iteration has one block.
                if u == 0 or j + u < run:
                    var b = first + j + u
                    var partial = row.codes[GROUP, 0](b) * x.unsafe_load[width=GROUP](
                        b * BLOCK_VALUES
                    )
                    comptime for g in range(1, GROUPS):
                        partial = row.codes[GROUP, g](b).fma(
                            x.unsafe_load[width=GROUP](b * BLOCK_VALUES + g * GROUP), partial
                        )
                    acc[u] = partial.fma(Group(scale_at[unsafe_offset=j + u]), acc[u])
            j += 2
        first += SCALE_RUN
    return (acc[0] + acc[1]).reduce_add() + offsets.reduce_add()


def _block_sums(x: F32Ptr, k: Int, sums: F32Ptr):
    """`sums[b]` = the sum of `x[b * 32 ..< b * 32 + 32]`."""
    for b in range(k // BLOCK_VALUES):
        var v = x.unsafe_load[width=GROUP](b * BLOCK_VALUES)
        comptime for g in range(1, GROUPS):
            v += x.unsafe_load[width=GROUP](b * BLOCK_VALUES + g * GROUP)
        sums[unsafe_offset=b] = v.reduce_add()


@fieldwise_init
struct _Products[encoding: StaticString](Job):
    """`y = x @ w.T` over a chunk of `chunk` rows of `w` per item: each chunk
    meets every row of `x` while its weights are in cache."""

    var y: F32Ptr
    var x: F32Ptr
    var x_sums: F32Ptr
    var w: BytePtr
    var m_rows: Int
    var n_rows: Int
    var k: Int
    var w_stride: Int
    var chunk: Int

    def run(self, item: Int):
        var first = item * self.chunk
        var last = min(self.n_rows, first + self.chunk)
        var k = self.k
        if self.m_rows == 1:
            var blocks = k // BLOCK_VALUES
            for n in range(first, last):
                var row = BlockRow[Self.encoding](self.w.unsafe_offset(n * self.w_stride), blocks)
                self.y[unsafe_offset=n] = _row_dot[Self.encoding](self.x, self.x_sums, k, row)
            return
        var w = self.w.unsafe_offset(first * self.w_stride)
        var y = self.y.unsafe_offset(first)
        if self.m_rows <= DIRECT_MR:
            _tiles[Self.encoding, DIRECT_MR, DIRECT_NR, False](
                self.m_rows, self.x, k, w, self.w_stride, last - first, y, self.n_rows
            )
            return
        var panel_storage = unsafe_alloc[Float32]((last - first) * k)
        var panel = F32Ptr(unsafe_from_address=Int(panel_storage))
        _dequantize_rows[Self.encoding](w, self.w_stride, last - first, k, panel)
        var m0 = 0
        while m0 < self.m_rows:
            var rows = min(PANEL_MR, self.m_rows - m0)
            _tiles[Self.encoding, PANEL_MR, PANEL_NR, True](
                rows,
                self.x.unsafe_offset(m0 * k),
                k,
                panel.unsafe_bitcast[UInt8](),
                k * size_of[Float32](),
                last - first,
                y.unsafe_offset(m0 * self.n_rows),
                self.n_rows,
            )
            m0 += rows
        panel_storage.unsafe_free()


def block_matmul[
    encoding: StaticString
](y: F32Ptr, x: F32Ptr, w: BytePtr, m_rows: Int, n_rows: Int, k: Int):
    """`y [m_rows, n_rows] = x [m_rows, k] @ w.T`, in items of `BLOCKS_PER_ITEM`
    block products or more (`parallel.run_items`)."""
    var blocks = k // BLOCK_VALUES
    var w_stride = blocks * block_bytes[encoding]()
    # A multiple of both register blocks' rows of `w`: only the last chunk can end in a
    # partial block.
    comptime ROWS = DIRECT_NR * PANEL_NR
    var chunk = ceildiv(ceildiv(BLOCKS_PER_ITEM, blocks * m_rows), ROWS) * ROWS
    if m_rows > 1:
        chunk = max(chunk, PANEL_ROWS)
    var x_sums = unsafe_alloc[Float32](blocks)
    comptime if encoding == "q4_1":  # for the minimums; q8_0 has none
        if m_rows == 1:
            _block_sums(x, k, F32Ptr(unsafe_from_address=Int(x_sums)))
    var job = _Products[encoding](
        y, x, F32Ptr(unsafe_from_address=Int(x_sums)), w, m_rows, n_rows, k, w_stride, chunk
    )
    run_items(job, ceildiv(n_rows, chunk))
    x_sums.unsafe_free()


@extensibility.register("mokv_quant.matmul")
struct BlockMatmul:
    """`output [M, N] = x [M, K] @ w.T`, `w` holding N rows of GGUF blocks."""

    @staticmethod
    def execute[
        encoding: StaticString, target: StaticString
    ](
        output: OutputTensor[dtype=DType.float32, rank=2, ...],
        x: InputTensor[dtype=DType.float32, rank=2, ...],
        w: InputTensor[dtype=DType.uint8, rank=2, ...],
        ctx: DeviceContext,
    ) raises:
        comptime assert is_cpu[target](), "mokv_weights runs on CPU only"
        var m_rows = x.dim_size(0)
        var k = x.dim_size(1)
        var n_rows = w.dim_size(0)
        if k % BLOCK_VALUES != 0:
            raise Error(t"x has {k} columns, not a multiple of {BLOCK_VALUES}")
        if w.dim_size(1) != (k // BLOCK_VALUES) * block_bytes[encoding]():
            raise Error(
                t"x has {k} columns but the {encoding} weight rows are {w.dim_size(1)} bytes"
            )
        if output.dim_size(0) != m_rows or output.dim_size(1) != n_rows:
            raise Error(
                t"output is [{output.dim_size(0)}, {output.dim_size(1)}], expected [{m_rows},"
                t" {n_rows}]"
            )
        block_matmul[encoding](
            output.unsafe_ptr().unsafe_origin_cast[MutUntrackedOrigin](),
            x.unsafe_ptr().unsafe_origin_cast[MutUntrackedOrigin](),
            w.unsafe_ptr().unsafe_origin_cast[MutUntrackedOrigin](),
            m_rows,
            n_rows,
            k,
        )
