"""How fast a GPU reads a cache's rows in the patterns a decode reads them, outside
any attention kernel: is the KV read rate bound by the rows' length?

The tenth GPU run found the 8-bit decode moving no more tiles a second than the
bfloat16 one with half the bytes a tile, and bfloat16 decode (mokv's and MAX's
alike) reading KV at 0.74 of a device copy's traffic. A paged cache holds each
token's heads side by side (`[pages, 2, layers, page_size, n_kv_heads, head_dim]`),
so a block that reads one KV head reads a row of `head_dim` elements from each
token: 256 bytes at a 2 KB stride for Llama's heads in bfloat16, 128 bytes at
1 KB in 8 bits. This times one pass over 1 GiB laid out as `[token, head, row]`:

- `contiguous`: each block reads one contiguous span (what a block reading every
  head of its tokens would read, or one reading one head's rows of a head-major
  page, 32 KB of them in bfloat16; the yardstick for the rest);
- `head rows R x H`: each block reads one head's `R`-byte rows of its tokens, the
  blocks of a token range's `H` heads next to each other in the grid (as
  `work.attention_grid` hands them out);
- `head rows R x H, 4 a block`: each warp of a block reads one head's rows, the
  block's four warps four neighbouring heads of the same tokens at once (a decode
  block whose warps split the heads, not the keys): whether requests for one
  token's neighbouring rows issued from one block, rather than from blocks
  running side by side, read as contiguous spans do;
- `head rows R x 8, 8 a block`: half a warp a head, so a block reads all eight of
  Llama's heads of its tokens, whole token rows (a decode block of eight warps,
  one a head): where `4 a block` falls short of contiguous spans and this does
  not, a block must cover its tokens' whole rows (eight heads a block, or a
  head-major page layout: docs/gpu.md).

Same blocks, threads and loads in flight in every pattern: 128 threads, each
with `LOADS` 16-byte loads in flight, as many blocks at once as a multiprocessor
takes; then again at a decode's concurrency (three blocks a multiprocessor, 32 KB
in flight each). If `head rows 128 x 8` reads at about half `head rows 256 x 8`'s
rate, the rows' length bounds the decode, and a decode block should read every
head of its tokens (its warps each one head, if the `4 a block` rows read as
contiguous spans do; else copying whole token rows together); if the patterns read alike with many blocks but not at a
decode's concurrency, the decode needs more bytes in flight; if they read alike in
both, the decode itself leaves bandwidth unused.

Run on a GPU: `.venv/bin/mojo run -I mojo tools/kv_read_patterns.mojo`
(`tools/gpu_proof.sh --read-patterns` does it as a step).
"""

from max.gpu import block_idx, thread_idx
from max.gpu.host import DeviceContext, FuncAttribute
from std.time import perf_counter_ns

from mokv_kernels.pointers import U32Ptr

comptime THREADS = 128
comptime WARPS = THREADS // 32
comptime LOADS = 8
"""16-byte loads each thread has in flight before it uses any."""
comptime DECODE_LOADS = 16
"""As many bytes in flight a block (32 KB) as a bfloat16 decode tile of Llama's heads."""
comptime DECODE_SHARED_BYTES = 72 * 1024
"""Unused shared memory that leaves room for 3 blocks on an H200's multiprocessor (228 KB),
as many as the tensor-core decode runs."""
comptime BYTES = 1 << 30
comptime BLOCK_BYTES = 1 << 18
"""Bytes each block reads: 4096 blocks over 1 GiB, about 31 per multiprocessor of an H200."""
comptime ROUNDS = 5
comptime CALLS = 10


def _read_rate[
    loads: Int
](
    ctx: DeviceContext,
    data: U32Ptr,
    sink: U32Ptr,
    row_bytes: Int,
    heads: Int,
    heads_a_block: Int,
    shared_bytes: Int,
) raises -> Float64:
    """GB/s of the best of `ROUNDS` rounds of `CALLS` passes over `[token, head,
    row_bytes]` rows, each block reading `heads_a_block` neighbouring heads' rows
    of its tokens, an equal share of its threads (whole warps) a head (one head of
    16-byte rows: contiguous spans) with `loads` 16-byte loads a thread in flight.
    Each block holds `shared_bytes` of shared memory it never touches: that bounds
    the blocks a multiprocessor runs at once."""
    # Whole token ranges of every head.
    var blocks = BYTES // BLOCK_BYTES // heads * heads
    # Kernel arguments: fixed-width integers.
    var words_a_row = Int64(row_bytes // 4)
    var lanes_a_row = Int64(row_bytes // 16)
    var rows_per_block = Int64(BLOCK_BYTES // (row_bytes * heads_a_block))
    var kv_heads = Int64(heads)
    var block_heads = Int64(heads_a_block)

    def read() {
        var data,
        var sink,
        var words_a_row,
        var lanes_a_row,
        var rows_per_block,
        var kv_heads,
        var block_heads,
    }:
        var heads = Int(kv_heads)
        var row_words = Int(words_a_row)
        var lanes_per_row = Int(lanes_a_row)
        var block = Int(block_idx.x)
        var thread = Int(thread_idx.x)
        # Divisions once per thread: the loop below only adds and multiplies.
        var head_blocks = heads // Int(block_heads)
        var head_threads = THREADS // Int(block_heads)
        var head = (block % head_blocks) * Int(block_heads) + thread // head_threads
        var head_thread = thread % head_threads
        var lane_word = 4 * (head_thread % lanes_per_row)
        var rows_per_load = head_threads // lanes_per_row
        var first_row = (block // head_blocks) * Int(rows_per_block)
        var row = first_row + head_thread // lanes_per_row
        var acc = SIMD[DType.uint32, 4](0)
        for _ in range(BLOCK_BYTES // (16 * THREADS * loads)):
            var chunks = Array[SIMD[DType.uint32, 4], loads](fill=0)
            comptime for k in range(loads):
                var word = (
                    (row + k * rows_per_load) * heads + head
                ) * row_words + lane_word
                chunks[k] = data.unsafe_load[width=4, alignment=16](word)
            comptime for k in range(loads):
                acc ^= chunks[k]
            row += loads * rows_per_load
        sink[unsafe_offset=block * THREADS + thread] = (
            acc[0] ^ acc[1] ^ acc[2] ^ acc[3]
        )

    var best = Float64(1e30)
    for _ in range(ROUNDS):
        var started = perf_counter_ns()
        for _ in range(CALLS):
            ctx.enqueue_function(
                read,
                grid_dim=blocks,
                block_dim=THREADS,
                shared_mem_bytes=shared_bytes,
                func_attribute=FuncAttribute.MAX_DYNAMIC_SHARED_SIZE_BYTES(
                    UInt32(shared_bytes)
                ),
            )
        ctx.synchronize()
        best = min(best, Float64(perf_counter_ns() - started) / CALLS)
    return Float64(blocks * BLOCK_BYTES) / best


def _table[
    loads: Int
](
    ctx: DeviceContext,
    data: U32Ptr,
    sink: U32Ptr,
    shared_bytes: Int,
    title: String,
) raises:
    """One markdown table: contiguous spans, then each pattern's rate and its ratio.
    """
    print("\n" + title + "\n")
    print("pattern | read GB/s | over contiguous")
    print("--- | ---: | ---:")
    var contiguous = _read_rate[loads](ctx, data, sink, 16, 1, 1, shared_bytes)
    print("contiguous |", round(contiguous, 1), "| 1.00")
    # Llama's heads in bfloat16 and in 8 bits, SmolLM2's (head_dim 64) likewise;
    # then Llama's with a block's four warps on four heads, and on all eight (half
    # a warp a head: each block reads its tokens' whole rows).
    var row_bytes: List[Int] = [256, 128, 128, 64, 256, 128, 256, 128]
    var heads: List[Int] = [8, 8, 3, 3, 8, 8, 8, 8]
    var heads_a_block: List[Int] = [1, 1, 1, 1, WARPS, WARPS, 2 * WARPS, 2 * WARPS]
    for i in range(len(row_bytes)):
        var rate = _read_rate[loads](
            ctx, data, sink, row_bytes[i], heads[i], heads_a_block[i], shared_bytes
        )
        var per_block = String(
            ", ", heads_a_block[i], " a block"
        ) if heads_a_block[i] > 1 else String("")
        print(
            "head rows",
            row_bytes[i],
            "x",
            String(heads[i]) + per_block,
            "|",
            round(rate, 1),
            "|",
            round(rate / contiguous, 2),
        )


def main() raises:
    var ctx = DeviceContext()
    var data_buffer = ctx.enqueue_create_buffer[DType.uint32](BYTES // 4)
    var sink_buffer = ctx.enqueue_create_buffer[DType.uint32](
        BYTES // BLOCK_BYTES * THREADS
    )
    ctx.enqueue_memset(data_buffer, 1)
    var data = data_buffer.unsafe_ptr().unsafe_origin_cast[MutUntrackedOrigin]()
    var sink = sink_buffer.unsafe_ptr().unsafe_origin_cast[MutUntrackedOrigin]()
    _table[LOADS](
        ctx,
        data,
        sink,
        0,
        (
            "As many blocks as fit (about 10 a multiprocessor), 16 KB in flight"
            " each"
        ),
    )
    _table[DECODE_LOADS](
        ctx,
        data,
        sink,
        DECODE_SHARED_BYTES,
        (
            "At a decode's concurrency: 3 blocks a multiprocessor, 32 KB in"
            " flight each"
        ),
    )
    _ = data_buffer^
    _ = sink_buffer^
