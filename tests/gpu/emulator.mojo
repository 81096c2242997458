"""Runs one GPU op of mokv under the CPU emulator (`mokv_kernels.gpu.block`).

`emulator DIR`: reads `DIR/meta.txt` (`key value` lines: op, layout, dtype,
sizes, scalars) and the raw little-endian arrays `DIR/<name>.bin` written by
`tests/gpu/emulation.py`, calls the op's GPU entry point (the very function
the op calls on a GPU) with the emulator as launcher, and writes what the op
wrote: `blocks_out.bin` for a store, `out.bin` for a gather or attention.
Op `warp` runs one emulated warp-collective step (`mokv_kernels.gpu.warp`)
on per-lane registers instead, writing every lane's result to `out.bin`.

The views hold untracked pointers into the byte lists read from disk, so
each list is kept alive (`_ = bytes^`) until the op has run.
"""

from std.memory import bitcast
from std.sys import argv, size_of
from std.utils import IndexList

from mokv_kernels.bind import bind_collection, layer_cache
from mokv_kernels.cache import BatchSummary, KVCollectionT
from mokv_kernels.gpu.attention.op import attention_gpu
from mokv_kernels.gpu.block import Emulator
from mokv_kernels.gpu.rows import gather_rows_gpu, store_kv_gpu
from mokv_kernels.gpu.views import InputView, MutableView, OutputView, row_major
from mokv_kernels.gpu.warp import BF16Ptr, WARP_LANES, ld_matrix, mma, shuffle_xor


struct Call:
    """One emulated call's directory and its `meta.txt`."""

    var dir: String
    var meta: Dict[String, String]

    def __init__(out self, dir: String) raises:
        self.dir = dir
        self.meta = Dict[String, String]()
        var text: String
        with open(dir + "/meta.txt", "r") as f:
            text = f.read()
        for line in text.splitlines():
            var parts = line.split(" ")
            if len(parts) == 2:
                self.meta[String(parts[0])] = String(parts[1])

    def int(self, key: String) raises -> Int:
        return Int(self.meta[key])

    def text(self, key: String) raises -> String:
        return self.meta[key]

    def read(self, name: String) raises -> List[UInt8]:
        with open(self.dir + "/" + name + ".bin", "r") as f:
            return f.read_bytes()

    def write(self, name: String, data: List[UInt8]) raises:
        with open(self.dir + "/" + name + ".bin", "w") as f:
            f.write_bytes(Span(data))


def _ptr[dtype: DType](mut bytes: List[UInt8]) -> Pointer[Scalar[dtype], MutUntrackedOrigin]:
    return (
        bytes.unsafe_ptr().unsafe_origin_cast[MutUntrackedOrigin]().unsafe_bitcast[Scalar[dtype]]()
    )


def _vector(call: Call, mut bytes: List[UInt8], name: String) raises -> InputView[DType.uint32, 1]:
    bytes = call.read(name)
    return InputView[DType.uint32, 1](
        _ptr[DType.uint32](bytes), IndexList[1](len(bytes) // 4), IndexList[1](1)
    )


def _run_op[
    collection_t: KVCollectionT
](call: Call, collection: collection_t, mut blocks: List[UInt8]) raises:
    comptime dtype = collection_t.CacheType.dtype
    var op = call.text("op")
    var emulator = Emulator(call.int("multiprocessors"), call.int("tensor_cores") == 1)
    var heads = call.int("n_kv_heads")
    var head_dim = call.int("head_dim")
    var layer = UInt32(call.int("layer"))
    var offsets_bytes = List[UInt8]()
    if op == "store":
        var tokens = call.int("tokens")
        var rows = IndexList[3](tokens, heads, head_dim)
        var keys_bytes = call.read("keys")
        var values_bytes = call.read("values")
        var keys = InputView[dtype, 3](_ptr[dtype](keys_bytes), rows, row_major(rows))
        var values = InputView[dtype, 3](_ptr[dtype](values_bytes), rows, row_major(rows))
        store_kv_gpu(
            emulator, collection, layer, keys, values, _vector(call, offsets_bytes, "row_offsets")
        )
        call.write("blocks_out", blocks)
        _ = keys_bytes^
        _ = values_bytes^
    elif op == "gather":
        var rows_bytes = List[UInt8]()
        var positions_bytes = List[UInt8]()
        var batch_rows = _vector(call, rows_bytes, "batch_rows")
        var positions = _vector(call, positions_bytes, "positions")
        var shape = IndexList[3](batch_rows.dim_size(0), heads, head_dim)
        var out = List[UInt8](length=shape.flattened_length() * size_of[Scalar[dtype]](), fill=0xFF)
        var dest = OutputView[dtype, 3](_ptr[dtype](out), shape, row_major(shape))
        var cache = layer_cache(collection, layer, UInt32(call.int("kv_idx")))
        gather_rows_gpu(emulator, cache, dest, batch_rows, positions)
        call.write("out", out)
        _ = rows_bytes^
        _ = positions_bytes^
    elif op == "attention":
        var shape = IndexList[3](call.int("tokens"), call.int("n_q_heads"), head_dim)
        var q_bytes = call.read("q")
        var q = InputView[dtype, 3](_ptr[dtype](q_bytes), shape, row_major(shape))
        var out = List[UInt8](length=shape.flattened_length() * size_of[Scalar[dtype]](), fill=0xFF)
        var output = OutputView[dtype, 3](_ptr[dtype](out), shape, row_major(shape))
        var scale = bitcast[DType.float32](UInt32(call.int("scale_bits")))
        var summary = BatchSummary.of_max_lengths(
            call.int("max_new_tokens"), call.int("max_context")
        )
        var offsets = _vector(call, offsets_bytes, "row_offsets")
        attention_gpu(
            emulator,
            collection,
            output,
            q,
            offsets,
            layer,
            scale,
            UInt32(call.int("window")),
            summary,
        )
        call.write("out", out)
        _ = q_bytes^
    else:
        raise Error(t"unknown op {op}")
    _ = offsets_bytes^


def _run[dtype: DType](call: Call) raises:
    var shape = IndexList[6](
        call.int("num_blocks"),
        2,
        call.int("num_layers"),
        call.int("block_len"),
        call.int("n_kv_heads"),
        call.int("head_dim"),
    )
    var blocks_bytes = call.read("blocks")
    var blocks = MutableView[dtype, 6](_ptr[dtype](blocks_bytes), shape, row_major(shape))
    var lengths_bytes = List[UInt8]()
    var lengths = _vector(call, lengths_bytes, "cache_lengths")
    var table_bytes = call.read("lookup_table")
    var table = _ptr[DType.uint32](table_bytes)
    var batch = lengths.dim_size(0)
    if call.text("layout") == "paged":
        var width = len(table_bytes) // 4 // max(batch, 1)
        var lookup = InputView[DType.uint32, 2](
            table, IndexList[2](batch, width), IndexList[2](width, 1)
        )
        _run_op(call, bind_collection(blocks, lengths, lookup), blocks_bytes)
    else:
        var lookup = InputView[DType.uint32, 1](table, IndexList[1](batch), IndexList[1](1))
        _run_op(call, bind_collection(blocks, lengths, lookup), blocks_bytes)
    _ = lengths_bytes^
    _ = table_bytes^


def _lanes[
    dtype: DType, width: Int
](mut bytes: List[UInt8]) -> Array[SIMD[dtype, width], WARP_LANES]:
    """Every lane's `width` values, lane-major."""
    var values = Array[SIMD[dtype, width], WARP_LANES](fill=0)
    var p = _ptr[dtype](bytes)
    for l in range(WARP_LANES):
        values[l] = p.unsafe_load[width=width](l * width)
    return values^


def _write_lanes[
    dtype: DType, width: Int
](call: Call, values: Array[SIMD[dtype, width], WARP_LANES]) raises:
    var out = List[UInt8](length=WARP_LANES * width * size_of[Scalar[dtype]](), fill=0)
    var p = _ptr[dtype](out)
    for l in range(WARP_LANES):
        p.unsafe_store(l * width, values[l])
    call.write("out", out)


def _ld_matrix[count: Int, transpose: Bool](call: Call) raises:
    var smem = call.read("smem")
    var rows_bytes = call.read("rows")
    var rows = _ptr[DType.uint32](rows_bytes)
    var addresses = Array[BF16Ptr, WARP_LANES](fill=_ptr[DType.bfloat16](smem))
    for l in range(WARP_LANES):
        addresses[l] = _ptr[DType.bfloat16](smem).unsafe_offset(Int(rows[unsafe_offset=l]) * 8)
    _write_lanes[DType.bfloat16, 2 * count](
        call, ld_matrix[count, transpose, WARP_LANES](addresses)
    )
    _ = smem^
    _ = rows_bytes^


def _run_warp(call: Call) raises:
    """One warp-collective step on the lanes' registers in the call's files."""
    var step = call.text("step")
    if step == "mma":
        var a = call.read("a")
        var b = call.read("b")
        var c = call.read("c")
        _write_lanes[DType.float32, 4](
            call,
            mma[WARP_LANES](
                _lanes[DType.bfloat16, 8](a),
                _lanes[DType.bfloat16, 4](b),
                _lanes[DType.float32, 4](c),
            ),
        )
    elif step == "shuffle_xor":
        var values = call.read("values")
        _write_lanes[DType.float32, 1](
            call, shuffle_xor[WARP_LANES](_lanes[DType.float32, 1](values), call.int("mask"))
        )
    elif step == "ld_matrix":
        var count = call.int("count")
        var transpose = call.int("transpose") == 1
        comptime for c in range(3):
            comptime n = 1 << c
            if count == n:
                if transpose:
                    _ld_matrix[n, True](call)
                else:
                    _ld_matrix[n, False](call)
    else:
        raise Error(t"unknown warp step {step}")


def main() raises:
    var call = Call(String(argv()[1]))
    if call.text("op") == "warp":
        _run_warp(call)
    elif call.text("dtype") == "float32":
        _run[DType.float32](call)
    elif call.text("dtype") == "bfloat16":
        _run[DType.bfloat16](call)
    else:
        raise Error(t"unsupported dtype {call.text('dtype')}")
