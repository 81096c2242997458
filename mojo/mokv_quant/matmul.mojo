"""`y = x @ w.T` for float32 `x [M, K]` and `w [N, K]` in GGUF blocks as
stored (`blocks.mojo`), the weights dequantized in registers.

The arithmetic is float32 throughout on exactly the weights the float32
format holds, so the two formats differ only in the order of the sums. That
matters more than speed here: quantizing the activations too (int8, as
llama.cpp and MAX's `qmatmul` do; bfloat16 likewise) makes every product
discontinuous in its input, so the last-bit differences between two attention
kernels (paged and dense) flip roundings, the flips grow from layer to layer,
and the two graphs' greedy tokens part wherever the top two logits are close.

A register block is `MR` rows of `x` by `NR` rows of `w`: each group of 8
weights is dequantized once and multiplied into `MR` rows, each product
accumulated in its own vector, summed across lanes once per output; a tile
of few rows keeps `CHAINS` accumulators per output, so enough FMAs are in
flight. One row of `x` (decode at batch 1) nothing reuses, so `_row_tile`
dequantizes each block as two 16-lane halves straight into its FMAs: fewer
instructions per weight byte, which is what that case is bound by.
"""

import extensibility
from extensibility import InputTensor, OutputTensor
from max.algorithm import sync_parallelize
from max.gpu.host import DeviceContext
from max.gpu.host.info import is_cpu
from max.runtime.asyncrt import parallelism_level
from std.math import ceildiv

from .blocks import (
    BLOCK_VALUES,
    GROUP,
    GROUPS,
    HALF,
    BlockScales,
    Half,
    BytePtr,
    F32Ptr,
    Group,
    block_bytes,
    dequantize,
    dequantize_half,
)

comptime MR = 6
"""Rows of `x` per register block."""
comptime NR = 2
"""Rows of `w` per register block (4 when `x` has one row)."""


@always_inline
def _tile[
    encoding: StaticString, R: Int, C: Int, CHAINS: Int
](x: F32Ptr, k: Int, w: BytePtr, w_stride: Int, y: F32Ptr, y_stride: Int):
    """`y[R, C] = x[R, k] @ w[C, k].T`, with `CHAINS` accumulators per output."""
    comptime BB = block_bytes[encoding]()
    var acc = Array[Group, R * C * CHAINS](fill=0)
    for b in range(k // BLOCK_VALUES):
        var scales = Array[BlockScales, C](fill=BlockScales(Group(0), Group(0)))
        comptime for c in range(C):
            scales[c] = BlockScales.load[encoding](w.unsafe_offset(c * w_stride + b * BB))
        comptime for g in range(GROUPS):
            var weights = Array[Group, C](fill=0)
            comptime for c in range(C):
                weights[c] = dequantize[encoding, g](
                    w.unsafe_offset(c * w_stride + b * BB), scales[c]
                )
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
def _row_tile[
    encoding: StaticString, C: Int
](x: F32Ptr, k: Int, w: BytePtr, w_stride: Int, y: F32Ptr):
    """`y[0, C] = x[1, k] @ w[C, k].T` for one row of `x` (a decode step at
    batch 1): each block's 32 weights in two 16-lane vectors, one
    accumulator per half block and output."""
    comptime BB = block_bytes[encoding]()
    var acc = Array[Half, 2 * C](fill=0)
    for b in range(k // BLOCK_VALUES):
        var x_low = x.unsafe_load[width=HALF](b * BLOCK_VALUES)
        var x_high = x.unsafe_load[width=HALF](b * BLOCK_VALUES + HALF)
        comptime for c in range(C):
            var block = w.unsafe_offset(c * w_stride + b * BB)
            acc[2 * c] = dequantize_half[encoding, 0](block).fma(x_low, acc[2 * c])
            acc[2 * c + 1] = dequantize_half[encoding, 1](block).fma(x_high, acc[2 * c + 1])
    comptime for c in range(C):
        y[unsafe_offset=c] = (acc[2 * c] + acc[2 * c + 1]).reduce_add()


def block_matmul[
    encoding: StaticString
](y: F32Ptr, x: F32Ptr, w: BytePtr, m_rows: Int, n_rows: Int, k: Int):
    """`y [m_rows, n_rows] = x [m_rows, k] @ w.T`, in parallel over chunks of `w`'s rows;
    each chunk meets every row of `x` while its weights are in cache."""
    var w_stride = (k // BLOCK_VALUES) * block_bytes[encoding]()
    var chunk = ceildiv(ceildiv(n_rows, parallelism_level(None) * 4), 4) * 4

    def run(
        item: Int,
    ) {var y, var x, var w, var m_rows, var n_rows, var k, var w_stride, var chunk}:
        var first = item * chunk
        var last = min(n_rows, first + chunk)
        if m_rows == 1:
            for n in range(first, last, 4):
                _row_tile[encoding, 4](
                    x, k, w.unsafe_offset(n * w_stride), w_stride, y.unsafe_offset(n)
                )
            return
        var m0 = 0
        while m0 < m_rows:
            var rows = min(MR, m_rows - m0)
            for n in range(first, last, NR):
                var xp = x.unsafe_offset(m0 * k)
                var wp = w.unsafe_offset(n * w_stride)
                var yp = y.unsafe_offset(m0 * n_rows + n)
                comptime for r in range(1, MR + 1):
                    if rows == r:
                        _tile[encoding, r, NR, 1 if r * NR >= 8 else 8 // (r * NR)](
                            xp, k, wp, w_stride, yp, n_rows
                        )
            m0 += rows

    sync_parallelize(run, ceildiv(n_rows, chunk))


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
        if n_rows % 4 != 0:
            raise Error(t"the weight has {n_rows} rows, not a multiple of 4")
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
