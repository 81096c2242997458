"""Runs one GPU op of mokv under the CPU emulator (`mokv_kernels.gpu.block`).

`emulator DIR`: reads `DIR/meta.txt` (`key value` lines: op, layout, dtype,
sizes, scalars) and the raw little-endian arrays `DIR/<name>.bin` written by
`tests/gpu/emulation.py`, calls the op's GPU entry point (the very function
the op calls on a GPU) with the emulator as launcher, and writes what the op
wrote: `blocks_out.bin` for a store, `out.bin` for a gather or attention
(and `launched.bin`, a line per kernel it launched: its name, the blocks per
multiprocessor its registers are sized for, and its grid's x, y and z).
A call naming a `format` (`float8_e4m3fn`, `int8`) runs on a paged quantized
cache: its codes in `blocks.bin` (float8 as uint8 bits), its scales in
`scales.bin`, queries and new rows in `dtype`; a store also writes
`scales_out.bin`, `gather_codes` the codes (`out.bin`) and their scales.
A `prefill_kernel` entry sets `MOKV_PREFILL_KERNEL` for the op (`mma` or
`wgmma`: which products the tensor-core prefill takes), and an entry named
`MOKV_...` sets that variable (`MOKV_ATTENTION_SPLITS`). Op `warp` runs one
emulated warp-collective step (`mokv_kernels.gpu.warp`, or a warpgroup
product of `mokv_kernels.gpu.warpgroup` as one warp of its group does it)
on per-lane registers instead, writing every lane's result to `out.bin`.

The views hold untracked pointers into the byte lists read from disk, so
each list is kept alive (`_ = bytes^`) until the op has run.
"""

from std.memory import bitcast
from std.os import setenv
from std.sys import argv, size_of
from std.utils import IndexList

from mokv_kernels.pointers import BF16Ptr
from mokv_kernels.bind import bind_collection, bind_scales, layer_cache
from mokv_kernels.cache.batch_summary import BatchSummary
from mokv_kernels.cache.traits import KVCollectionT
from mokv_kernels.gpu.attention.op import attention_gpu
from mokv_kernels.gpu.block import Emulator
from mokv_kernels.gpu.shared_memory import SharedMemory
from mokv_kernels.gpu.mbarrier import BARRIER_BYTES, SharedBarrier
from mokv_kernels.gpu.tensor_map import PageMaps
from mokv_kernels.gpu.quantized import (
    gather_codes_gpu,
    gather_quantized_gpu,
    store_kv_quantized_gpu,
)
from mokv_kernels.gpu.rows import gather_rows_gpu, store_kv_gpu
from mokv_kernels.kv_quantization import codes_in, is_quantized
from mokv_kernels.gpu.views import InputView, MutableView, OutputView, row_major
from mokv_kernels.gpu.warp import WARP, FragA, Frags, ld_matrix, mma, shuffle_xor

from call_files import Call, bytes_ptr, lane_values, write_lane_values
from warp_steps import WarpSteps, box_tensor, run_warp_step, start_boxes, wgmma_product


def _vector(call: Call, mut bytes: List[UInt8], name: String) raises -> InputView[DType.uint32, 1]:
    bytes = call.read(name)
    return InputView[DType.uint32, 1](
        bytes_ptr[DType.uint32](bytes), IndexList[1](len(bytes) // 4), IndexList[1](1)
    )


def _rows_view[
    dtype: DType
](call: Call, mut bytes: List[UInt8], name: String) raises -> InputView[dtype, 3]:
    """New token rows `[tokens, n_kv_heads, head_dim]` from `name.bin`."""
    bytes = call.read(name)
    var rows = IndexList[3](call.int("tokens"), call.int("n_kv_heads"), call.int("head_dim"))
    return InputView[dtype, 3](bytes_ptr[dtype](bytes), rows, row_major(rows))


def _output[dtype: DType](mut bytes: List[UInt8], shape: IndexList[3]) -> OutputView[dtype, 3]:
    """An output over `bytes`, first filled with 0xFF bytes (so rows the op
    never writes show)."""
    bytes = List[UInt8](length=shape.flattened_length() * size_of[Scalar[dtype]](), fill=0xFF)
    return OutputView[dtype, 3](bytes_ptr[dtype](bytes), shape, row_major(shape))


def _run_op[
    collection_t: KVCollectionT, q_dtype: DType, codes_dtype: DType
](call: Call, collection: collection_t, blocks: List[UInt8], scales: List[UInt8]) raises:
    """Runs the call's op. Queries, outputs and new rows are `q_dtype`; a
    quantized cache's codes travel as `codes_dtype` (its blocks' dtype)."""
    comptime quantized = is_quantized[collection_t.CacheType.dtype]()
    var op = call.text("op")
    if "prefill_kernel" in call.meta:
        _ = setenv("MOKV_PREFILL_KERNEL", call.text("prefill_kernel"))
    for entry in call.meta.items():
        if entry.key.startswith("MOKV_"):
            _ = setenv(entry.key, entry.value)
    var emulator = Emulator(call.int("multiprocessors"), call.int("tensor_cores") == 1)
    var layer = UInt32(call.int("layer"))
    var offsets_bytes = List[UInt8]()
    var rows_bytes = List[UInt8]()
    var positions_bytes = List[UInt8]()
    var first = List[UInt8]()
    var second = List[UInt8]()
    if op == "store":
        var keys = _rows_view[q_dtype](call, first, "keys")
        var values = _rows_view[q_dtype](call, second, "values")
        var offsets = _vector(call, offsets_bytes, "row_offsets")
        comptime if quantized:
            store_kv_quantized_gpu(emulator, collection, layer, keys, values, offsets)
            call.write("scales_out", scales)
        else:
            store_kv_gpu(emulator, collection, layer, keys, values, offsets)
        call.write("blocks_out", blocks)
    elif op == "gather" or op == "gather_codes":
        var batch_rows = _vector(call, rows_bytes, "batch_rows")
        var positions = _vector(call, positions_bytes, "positions")
        var shape = IndexList[3](
            batch_rows.dim_size(0), call.int("n_kv_heads"), call.int("head_dim")
        )
        var cache = layer_cache(collection, layer, UInt32(call.int("kv_idx")))
        if op == "gather":
            var dest = _output[q_dtype](first, shape)
            comptime if quantized:
                gather_quantized_gpu(emulator, cache, dest, batch_rows, positions)
            else:
                gather_rows_gpu(emulator, cache, dest, batch_rows, positions)
        else:
            comptime if quantized:
                var codes = _output[codes_dtype](first, shape)
                var scale_shape = IndexList[3](shape[0], shape[1], call.int("granules"))
                gather_codes_gpu(
                    emulator,
                    cache,
                    codes,
                    _output[DType.float32](second, scale_shape),
                    batch_rows,
                    positions,
                )
                call.write("scales_out", second)
        call.write("out", first)
    elif op == "attention":
        var shape = IndexList[3](call.int("tokens"), call.int("n_q_heads"), call.int("head_dim"))
        var q_bytes = call.read("q")
        var q = InputView[q_dtype, 3](bytes_ptr[q_dtype](q_bytes), shape, row_major(shape))
        var output = _output[q_dtype](first, shape)
        var summary = BatchSummary.of_max_lengths(
            call.int("max_new_tokens"), call.int("max_context")
        )
        attention_gpu(
            emulator,
            collection,
            output,
            q,
            _vector(call, offsets_bytes, "row_offsets"),
            layer,
            bitcast[DType.float32](UInt32(call.int("scale_bits"))),
            UInt32(call.int("window")),
            summary,
        )
        call.write("out", first)
        call.write("launched", List[UInt8]("\n".join(emulator.launched).as_bytes()))
        _ = q_bytes^
    else:
        raise Error(t"unknown op {op}")
    # The views hold untracked pointers into these lists: keep them alive.
    _ = offsets_bytes^
    _ = rows_bytes^
    _ = positions_bytes^
    _ = first^
    _ = second^


def _run[blocks_dtype: DType, q_dtype: DType](call: Call) raises:
    """Binds the call's cache (`blocks_dtype` values, or quantized codes with
    their scales when the call names a format) and runs its op."""
    var shape = IndexList[6](
        call.int("num_blocks"),
        2,
        call.int("num_layers"),
        call.int("block_len"),
        call.int("n_kv_heads"),
        call.int("head_dim"),
    )
    var blocks_bytes = call.read("blocks")
    var blocks = MutableView[blocks_dtype, 6](
        bytes_ptr[blocks_dtype](blocks_bytes), shape, row_major(shape)
    )
    var lengths_bytes = List[UInt8]()
    var lengths = _vector(call, lengths_bytes, "cache_lengths")
    var table_bytes = call.read("lookup_table")
    var table = bytes_ptr[DType.uint32](table_bytes)
    var batch = lengths.dim_size(0)
    var scales_bytes = List[UInt8]()
    comptime if blocks_dtype == DType.uint8 or blocks_dtype == DType.int8:
        # Quantized, paged: float8 codes travel as their uint8 bits.
        comptime codes = codes_in[blocks_dtype]()
        scales_bytes = call.read("scales")
        var scale_shape = IndexList[6](
            shape[0],
            2,
            shape[2],
            shape[3] // call.int("tokens_per_scale"),
            shape[4],
            call.int("granules"),
        )
        var scales = MutableView[DType.float32, 6](
            bytes_ptr[DType.float32](scales_bytes), scale_shape, row_major(scale_shape)
        )
        var width = len(table_bytes) // 4 // max(batch, 1)
        var lookup = InputView[DType.uint32, 2](
            table, IndexList[2](batch, width), IndexList[2](width, 1)
        )
        var collection = bind_collection[codes](
            blocks, lengths, lookup, bind_scales[codes](blocks, scales)
        )
        _run_op[q_dtype=q_dtype, codes_dtype=blocks_dtype](
            call, collection, blocks_bytes, scales_bytes
        )
    else:
        if call.text("layout") == "paged":
            var width = len(table_bytes) // 4 // max(batch, 1)
            var lookup = InputView[DType.uint32, 2](
                table, IndexList[2](batch, width), IndexList[2](width, 1)
            )
            _run_op[q_dtype=q_dtype, codes_dtype=blocks_dtype](
                call, bind_collection(blocks, lengths, lookup), blocks_bytes, scales_bytes
            )
        else:
            var lookup = InputView[DType.uint32, 1](table, IndexList[1](batch), IndexList[1](1))
            _run_op[q_dtype=q_dtype, codes_dtype=blocks_dtype](
                call, bind_collection(blocks, lengths, lookup), blocks_bytes, scales_bytes
            )
    _ = lengths_bytes^
    _ = table_bytes^


struct EmulatedSteps(WarpSteps):
    """The `warp` op's steps on the CPU: one program holds every lane."""

    def __init__(out self):
        pass

    def mma(mut self, call: Call) raises:
        var a_bytes = call.read("a")
        var b_bytes = call.read("b")
        var c_bytes = call.read("c")
        var a = lane_values[DType.bfloat16, 8](a_bytes)
        var b = lane_values[DType.bfloat16, 4](b_bytes)
        var c = lane_values[DType.float32, 4](c_bytes)
        if call.int("float16") != 0:
            write_lane_values[DType.float32, 4](call, mma[WARP, DType.float16](a, b, c))
        else:
            write_lane_values[DType.float32, 4](call, mma[WARP](a, b, c))

    def shuffle_xor(mut self, call: Call) raises:
        var values = call.read("values")
        write_lane_values[DType.float32, 1](
            call, shuffle_xor[WARP](lane_values[DType.float32, 1](values), call.int("mask"))
        )

    def ld_matrix[count: Int, transpose: Bool](mut self, call: Call) raises:
        var smem = call.read("smem")
        var rows_bytes = call.read("rows")
        var rows = bytes_ptr[DType.uint32](rows_bytes)
        var addresses = Array[BF16Ptr, WARP](fill=bytes_ptr[DType.bfloat16](smem))
        for l in range(WARP):
            addresses[l] = bytes_ptr[DType.bfloat16](smem).unsafe_offset(
                Int(rows[unsafe_offset=l]) * 8
            )
        write_lane_values[DType.bfloat16, 2 * count](
            call, ld_matrix[count, transpose, WARP](addresses)
        )
        _ = smem^
        _ = rows_bytes^

    def wgmma[n: Int](mut self, call: Call) raises:
        """One warp's share (warp `warp` of its group) of the product."""
        var a_tile = call.read("a_tile")
        var b_tile = call.read("b_tile")
        var c_bytes = call.read("c")
        var c = lane_values[DType.float32, n // 2](c_bytes)
        var d = Frags[DType.float32, 4, n // 8, WARP](0)
        for l in range(WARP):
            comptime for i in range(n // 8):
                d[i, l] = c[l].slice[4, offset=4 * i]()
        var a_shared = call.int("a_shared") == 1
        var a_bytes = List[UInt8]() if a_shared else call.read("a")
        var a = Array[FragA, WARP](fill=0)
        if not a_shared:
            a = lane_values[DType.bfloat16, 8](a_bytes)
        wgmma_product[n](
            SharedMemory(bytes_ptr[DType.uint8](a_tile), 0),
            SharedMemory(bytes_ptr[DType.uint8](b_tile), 0),
            a,
            d,
            a_shared,
            call.int("b_major") == 1,
            call.int("k_step"),
            call.int("warp"),
        )
        var out = Array[SIMD[DType.float32, n // 2], WARP](fill=0)
        for l in range(WARP):
            comptime for i in range(n // 8):
                out[l] = out[l].insert[offset=4 * i](d[i, l])
        write_lane_values[DType.float32, n // 2](call, out)
        _ = a_tile^
        _ = b_tile^

    def mbarrier(mut self, call: Call) raises:
        var smem = List[UInt8](length=BARRIER_BYTES, fill=0)
        var start = smem.unsafe_ptr().unsafe_origin_cast[MutUntrackedOrigin]()
        var phases = SharedBarrier(SharedMemory(start, 0), 0)
        phases.init(call.int("count"))
        for _ in range(call.int("first")):
            phases.arrive[1]()
        for _ in range(call.int("second")):
            phases.arrive[1]()
        var out = Array[SIMD[DType.uint32, 2], WARP](
            fill=SIMD[DType.uint32, 2](
                UInt32(1 if phases.is_complete(0) else 0), UInt32(1 if phases.is_complete(1) else 0)
            )
        )
        write_lane_values[DType.uint32, 2](call, out)
        _ = smem^

    def box(mut self, call: Call) raises:
        var tensor = call.read("tensor")
        var boxes = call.read("boxes")
        var shared_bytes = call.int("shared_bytes")
        var smem = List[UInt8](length=shared_bytes + BARRIER_BYTES, fill=0xFF)
        var start = smem.unsafe_ptr().unsafe_origin_cast[MutUntrackedOrigin]()
        var shared = SharedMemory(start, 0)
        var landed = SharedBarrier(shared, shared_bytes)
        landed.init(1)
        var maps = PageMaps(0, box_tensor(call, Int(bytes_ptr[DType.bfloat16](tensor))))
        start_boxes(maps, landed, bytes_ptr[DType.int32](boxes), call.int("count"))
        # Looking at the barrier lands the boxes (`mokv_kernels.gpu.mbarrier`).
        var done = UInt32(1 if landed.is_complete(0) else 0)
        var out = List[UInt8](capacity=shared_bytes + 4)
        for i in range(shared_bytes):
            out.append(smem[i])
        for i in range(4):
            out.append(UInt8((done >> UInt32(8 * i)) & 0xFF))
        call.write("out", out)
        _ = smem^
        _ = tensor^
        _ = boxes^


def main() raises:
    var call = Call(String(argv()[1]))
    if call.text("op") == "warp":
        var steps = EmulatedSteps()
        run_warp_step(steps, call)
        return
    var dtype = call.text("dtype")
    if "format" in call.meta:
        # A quantized cache: `dtype` is the queries' and new rows'.
        var fmt = call.text("format")
        comptime for q in range(2):
            comptime q_dtype = DType.float32 if q == 0 else DType.bfloat16
            if dtype == String(q_dtype):
                if fmt == "float8_e4m3fn":
                    _run[DType.uint8, q_dtype](call)
                elif fmt == "int8":
                    _run[DType.int8, q_dtype](call)
                else:
                    raise Error(t"unsupported format {fmt}")
    elif dtype == "float32":
        _run[DType.float32, DType.float32](call)
    elif dtype == "bfloat16":
        _run[DType.bfloat16, DType.bfloat16](call)
    else:
        raise Error(t"unsupported dtype {dtype}")
