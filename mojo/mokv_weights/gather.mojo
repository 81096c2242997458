"""Embedding lookup from a table of planar rows of GGUF blocks."""

import extensibility
from extensibility import InputTensor, OutputTensor
from max.gpu.host import DeviceContext
from max.gpu.host.info import is_cpu

from .blocks import BLOCK_VALUES, GROUP, GROUPS, BlockRow, block_bytes


@extensibility.register("mokv_quant.gather_rows")
struct GatherRows:
    """`output[i] = dequantize(table[ids[i]])`, float32."""

    @staticmethod
    def execute[
        encoding: StaticString, target: StaticString
    ](
        output: OutputTensor[dtype=DType.float32, rank=2, ...],
        table: InputTensor[dtype=DType.uint8, rank=2, ...],
        ids: InputTensor[dtype=DType.int64, rank=1, ...],
        ctx: DeviceContext,
    ) raises:
        comptime assert is_cpu[target](), "mokv_weights runs on CPU only"
        comptime BB = block_bytes[encoding]()
        var columns = output.dim_size(1)
        var rows = table.dim_size(0)
        var row_bytes = table.dim_size(1)
        if columns % BLOCK_VALUES != 0 or row_bytes != (columns // BLOCK_VALUES) * BB:
            raise Error(t"{columns} columns do not fit {encoding} table rows of {row_bytes} bytes")
        var src = table.unsafe_ptr().unsafe_origin_cast[MutUntrackedOrigin]()
        var dst = output.unsafe_ptr().unsafe_origin_cast[MutUntrackedOrigin]()
        var id_ptr = ids.unsafe_ptr()
        for i in range(ids.dim_size(0)):
            var row = Int(id_ptr[unsafe_offset=i])
            if row < 0 or row >= rows:
                raise Error(t"token id {row} is outside the table's {rows} rows")
            var stored = BlockRow[encoding](
                src.unsafe_offset(row * row_bytes), columns // BLOCK_VALUES
            )
            for b in range(columns // BLOCK_VALUES):
                var scales = stored.scales(b)
                comptime for g in range(GROUPS):
                    dst.unsafe_store(
                        i * columns + b * BLOCK_VALUES + g * GROUP, stored.dequantize[g](b, scales)
                    )
