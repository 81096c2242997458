"""`y = x @ w.T` for float32 `x [M, K]` and `w [N, K]` in planar rows of GGUF
blocks (`blocks.mojo`), the weights dequantized in registers.

The arithmetic is float32 throughout on exactly the weights the float32
format holds, so the two formats differ only in the order of the sums. That
matters more than speed here: quantizing the activations too (int8, as
llama.cpp and MAX's `qmatmul` do; bfloat16 likewise) makes every product
discontinuous in its input, so the last-bit differences between two attention
kernels (paged and dense) flip roundings, the flips grow from layer to layer,
and the two graphs' greedy tokens part wherever the top two logits are close.

A register block is `MR` rows of `x` by `NR` rows of `w`: each vector of `GROUP`
weights is dequantized once and multiplied into `MR` rows, each product
accumulated in its own vector, summed across lanes once per output; a tile
of few rows keeps `CHAINS` accumulators per output, so enough FMAs are in
flight. One row of `x` (decode at batch 1) nothing reuses, so `_row_dot`
applies each block's scale once, to the block's partial product, instead of to
each weight: `w . x = sum_b d_b (q_b . x_b) + m_b sum(x_b)`, the second sum over
the row's minimums and `x`'s block sums (`_block_sums`, once per call). That is
a multiply-add per 32 weights instead of two, and 27% less time per block. It
reads one weight row at a time: a single stream the hardware prefetcher
follows across pages, where four rows read side by side (four streams ~1 KB
apart) ran at half the speed on `ffn_down`.
"""

import extensibility
from extensibility import InputTensor, OutputTensor
from max.gpu.host import DeviceContext
from max.gpu.host.info import is_cpu
from std.math import ceildiv
from std.sys import prefetch
from std.sys.info import CompilationTarget

from .blocks import (
    BLOCK_VALUES,
    GROUP,
    GROUPS,
    BlockRow,
    BlockScales,
    BytePtr,
    F32Ptr,
    Group,
    block_bytes,
)
from .parallel import Job, run_items

comptime MR = 8 if CompilationTarget.has_avx512f() else 6
"""Rows of `x` per register block: as many as leave the weights, `x` and the scales a
register each beside the `MR * NR` accumulators (32 vector registers with AVX-512, 16 without)."""
comptime NR = 2
"""Rows of `w` per register block."""
comptime PREFETCH_AHEAD = 4096
"""Bytes ahead of the weight rows being read that the products prefetch: a decode step
streams ~96 MB of weights from memory, and the hardware prefetcher stops at every 4 KB
page (products 5-7% faster at batch 1, 8-9% at 16 rows of `x`; 2 KB gained less, 16 KB
lost 3-5%, 8 KB ahead of a register block's two rows the same as 4 KB)."""
comptime BLOCKS_PER_ITEM = 4096
"""Block products per parallel item, at least: 4-8 us of work, so a product of
fewer runs on the calling thread alone, and taking an item costs little beside it."""
comptime SCALE_RUN = 16
"""Blocks whose scales `_row_dot` converts at once (one float16 vector)."""


@always_inline
def _tile[
    encoding: StaticString, R: Int, C: Int, CHAINS: Int
](x: F32Ptr, k: Int, w: BytePtr, w_stride: Int, y: F32Ptr, y_stride: Int):
    """`y[R, C] = x[R, k] @ w[C, k].T`, with `CHAINS` accumulators per output."""
    var blocks = k // BLOCK_VALUES
    var rows = Array[BlockRow[encoding], C](uninitialized=True)
    comptime for c in range(C):
        rows[c] = BlockRow[encoding](w.unsafe_offset(c * w_stride), blocks)
    var acc = Array[Group, R * C * CHAINS](fill=0)
    for b in range(blocks):
        # The `C` rows' bytes are contiguous: this walks them, `PREFETCH_AHEAD` ahead.
        prefetch(w.unsafe_offset(PREFETCH_AHEAD + b * C * block_bytes[encoding]()))
        var scales = Array[BlockScales, C](fill=BlockScales(Group(0), Group(0)))
        comptime for c in range(C):
            scales[c] = rows[c].scales(b)
        comptime for g in range(GROUPS):
            var weights = Array[Group, C](fill=0)
            comptime for c in range(C):
                weights[c] = rows[c].dequantize[g](b, scales[c])
            comptime for r in range(R):
                var xv = x.unsafe_load[width=GROUP](r * k + b * BLOCK_VALUES + g * GROUP)
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
    encoding: StaticString, C: Int
](rows: Int, x: F32Ptr, k: Int, w: BytePtr, w_stride: Int, y: F32Ptr, y_stride: Int):
    """`_tile` for `rows <= MR` rows of `x` (known only at run time) by `C` rows of `w`."""
    comptime for r in range(1, MR + 1):
        if rows == r:
            _tile[encoding, r, C, 1 if r * C >= 8 else 8 // (r * C)](x, k, w, w_stride, y, y_stride)


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
        var m0 = 0
        while m0 < self.m_rows:
            var rows = min(MR, self.m_rows - m0)
            for n in range(first, last, NR):
                var xp = self.x.unsafe_offset(m0 * k)
                var wp = self.w.unsafe_offset(n * self.w_stride)
                var yp = self.y.unsafe_offset(m0 * self.n_rows + n)
                if last - n >= NR:
                    _tile_of[Self.encoding, NR](rows, xp, k, wp, self.w_stride, yp, self.n_rows)
                else:  # the weight's odd last row
                    _tile_of[Self.encoding, 1](rows, xp, k, wp, self.w_stride, yp, self.n_rows)
            m0 += rows


def block_matmul[
    encoding: StaticString
](y: F32Ptr, x: F32Ptr, w: BytePtr, m_rows: Int, n_rows: Int, k: Int):
    """`y [m_rows, n_rows] = x [m_rows, k] @ w.T`, in items of `BLOCKS_PER_ITEM`
    block products or more (`parallel.run_items`)."""
    var blocks = k // BLOCK_VALUES
    var w_stride = blocks * block_bytes[encoding]()
    # A multiple of 4 rows, so of `NR`: only the last chunk can end on an odd row.
    var chunk = ceildiv(ceildiv(BLOCKS_PER_ITEM, blocks * m_rows), 4) * 4
    var x_sums = alloc[Float32](blocks)
    comptime if encoding == "q4_1":  # for the minimums; q8_0 has none
        if m_rows == 1:
            _block_sums(x, k, F32Ptr(unsafe_from_address=Int(x_sums)))
    var job = _Products[encoding](
        y, x, F32Ptr(unsafe_from_address=Int(x_sums)), w, m_rows, n_rows, k, w_stride, chunk
    )
    run_items(job, ceildiv(n_rows, chunk))
    x_sums.free()


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
        comptime assert is_cpu[target](), "mokv_quant runs on CPU only"
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
