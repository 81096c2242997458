"""`mokv_quant`'s `block_matmul` called directly, outside any MAX graph: the rate
its products reach on this machine's workers, to hold against what the same
products reach inside a graph (`mokv bench weights`). Weights are cycled
through four 17.7 MB matrices (49152 q4_1 rows of 576 columns, SmolLM2's LM
head), so they stream from memory as a decode step's do.

Run: .venv/bin/mojo run -I mojo tools/quant_matmul_bench.mojo
"""

from std.time import perf_counter_ns

from mokv_quant.blocks import BLOCK_VALUES, BytePtr, F32Ptr, block_bytes, code_bytes
from mokv_quant.matmul import block_matmul

comptime K = 576
comptime N = 49152
comptime COPIES = 4
comptime BLOCKS = K // BLOCK_VALUES
comptime STRIDE = BLOCKS * block_bytes["q4_1"]()
comptime CODES = BLOCKS * code_bytes["q4_1"]()
"""Bytes of a planar row's codes, before its scales and minimums."""
comptime REPEATS = 8


def best_ns(rows: Int, y: F32Ptr, x: F32Ptr, w: BytePtr) -> Float64:
    """The fastest of `REPEATS` products of `rows` rows of `x`, each with the next copy."""
    var best = Float64(1e30)
    for rep in range(REPEATS):
        var started = perf_counter_ns()
        block_matmul["q4_1"](y, x, w.unsafe_offset((rep % COPIES) * N * STRIDE), rows, N, K)
        best = min(best, Float64(perf_counter_ns() - started))
    return best


def main():
    var weights = alloc[UInt8](COPIES * N * STRIDE)
    var w = BytePtr(unsafe_from_address=Int(weights))
    for i in range(COPIES * N * STRIDE):
        w[unsafe_offset=i] = UInt8((i * 37) % 251)
    for n in range(COPIES * N):  # scales and minimums: small finite float16s
        var fields = w.unsafe_offset(n * STRIDE + CODES).unsafe_bitcast[Float16]()
        for b in range(2 * BLOCKS):
            fields[unsafe_offset=b] = Float16(0.01 * Float32(b % 7 + 1))
    var activations = alloc[Float32](16 * K)
    var x = F32Ptr(unsafe_from_address=Int(activations))
    for i in range(16 * K):
        x[unsafe_offset=i] = Float32((i % 13) - 6) * 0.1
    var outputs = alloc[Float32](16 * N)
    var y = F32Ptr(unsafe_from_address=Int(outputs))
    for _ in range(3):
        var one = best_ns(1, y, x, w)
        var sixteen = best_ns(16, y, x, w)
        print(
            "1 row:",
            one / Float64(N * BLOCKS),
            "ns per block;  16 rows:",
            Float64(16 * N * K) / sixteen,
            "GMAC/s",
        )
    weights.free()
    activations.free()
    outputs.free()
