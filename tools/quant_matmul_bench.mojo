"""`mokv_weights`'s `block_matmul` called directly, outside any MAX graph: the rate
each of a SmolLM2 step's product shapes reaches on this machine's workers at 1, 16
and 64 rows of activations, to hold against what the same products reach inside a
graph (`mokv bench weights`), plus one wide Llama-8B-like shape. Each shape cycles
through copies of its weights (at least 64 MB in all), so they stream from memory
as a decode step's do; the best of `REPEATS` products is kept.

Run: .venv/bin/mojo build -I mojo tools/quant_matmul_bench.mojo -o /tmp/quant_matmul_bench
&& /tmp/quant_matmul_bench (built, not `mojo run`: see `parallel.mojo` on helpers that
outlive their call)
"""

from std.math import ceildiv
from std.memory.alloc import unsafe_alloc
from std.time import perf_counter_ns

from mokv_weights.blocks import BLOCK_VALUES, block_bytes, code_bytes
from mokv_weights.matmul import block_matmul
from mokv_weights.pointers import BytePtr, F32Ptr

comptime REPEATS = 24
comptime STREAMED_BYTES = 64 << 20
"""Weight bytes a shape's copies span at least: more than the last-level cache."""


def fill_rows[encoding: StaticString](w: BytePtr, rows: Int, k: Int):
    """Arbitrary codes, and small finite float16 scales (and minimums)."""
    var blocks = k // BLOCK_VALUES
    var stride = blocks * block_bytes[encoding]()
    for i in range(rows * stride):
        w[unsafe_offset=i] = UInt8((i * 37) % 251)
    var fields_per_row = 2 * blocks if encoding == "q4_1" else blocks
    for r in range(rows):
        var fields = w.unsafe_offset(r * stride + blocks * code_bytes[encoding]())
        var halves = fields.unsafe_bitcast[Float16]()
        for b in range(fields_per_row):
            halves[unsafe_offset=b] = Float16(0.01 * Float32(b % 7 + 1))


def gmacs[encoding: StaticString](n: Int, k: Int, m: Int) -> Float64:
    """Multiply-adds per ns of the fastest of `REPEATS` products `[m, k] x [n, k].T`."""
    var bytes = n * (k // BLOCK_VALUES) * block_bytes[encoding]()
    var copies = max(2, ceildiv(STREAMED_BYTES, bytes))
    var weights = unsafe_alloc[UInt8](copies * bytes)
    var w = BytePtr(unsafe_from_address=Int(weights))
    fill_rows[encoding](w, copies * n, k)
    var activations = unsafe_alloc[Float32](m * k)
    var x = F32Ptr(unsafe_from_address=Int(activations))
    for i in range(m * k):
        x[unsafe_offset=i] = Float32((i % 13) - 6) * 0.1
    var outputs = unsafe_alloc[Float32](m * n)
    var y = F32Ptr(unsafe_from_address=Int(outputs))
    var best = Float64(1e30)
    for rep in range(REPEATS):
        var started = perf_counter_ns()
        block_matmul[encoding](y, x, w.unsafe_offset((rep % copies) * bytes), m, n, k)
        best = min(best, Float64(perf_counter_ns() - started))
    weights.unsafe_free()
    activations.unsafe_free()
    outputs.unsafe_free()
    return Float64(m * n * k) / best


def main():
    print("GMAC/s, best of", REPEATS, "| rows of x: 1, 16, 64")
    for m in [1, 16, 64]:
        print(
            "rows",
            m,
            "| qkv 960x576:",
            gmacs["q4_1"](960, 576, m),
            "| o 576x576:",
            gmacs["q4_1"](576, 576, m),
            "| gate+up 3072x576:",
            gmacs["q4_1"](3072, 576, m),
            "| down 576x1536:",
            gmacs["q4_1"](576, 1536, m),
            "| lm head 49152x576 q8_0:",
            gmacs["q8_0"](49152, 576, m),
            "| wide 4096x14336:",
            gmacs["q4_1"](4096, 14336, m),
        )
