"""Flash attention of a ragged batch over the cache, on a GPU.

Same semantics as the CPU op (`mokv_kernels.attention`): new token i of batch
row b sits at position `cache_lengths[b] + i` and attends to positions
`0 ..= cache_lengths[b] + i` of its own sequence (the last W with a sliding
window), query head h reading KV head `h // group`.

One thread block per (query tile, KV head, batch row, split): its query rows
are consecutive new tokens of the row times the `group` query heads sharing
the KV head, so every K/V element a block loads serves the whole GQA group.
Split-K: when the grid would not cover the device, the context is cut into
`splits` ranges, each block writes its unnormalised state (output, max, sum)
to scratch, and the merge combines them per (token, head). The grid is sized
on the host from the batch summary without reading device memory; each block
reads its row's offsets and cache length itself. Rows with more new tokens
than the bound are not fully covered: the bound must hold (the manager's
`max_lengths` does).

The package, one concept per module (as the CPU one):

- `config`: block shape, decode rows, softmax constants, split thresholds;
- `work`: a block's arguments, its rows and context range, writing its rows;
- `softmax`: the online softmax over a tile of scores in shared memory;
- `plan`: the batch's bounds and how it is cut into blocks;
- `decode`: a few query rows against a long context (flash decoding), on
  CUDA cores;
- `prefill`: larger query tiles on CUDA cores;
- `mma`: decode and prefill of bfloat16 and 8-bit caches on tensor cores,
  one thread's (under the emulator one warp's) program;
- `mma_kernel`: their grid and the order a block runs that program's phases;
- `mma_products`: a warp's Q Kᵀ and P V (`mma.sync`, over 8-bit codes in
  registers, or a warpgroup's `wgmma`);
- `mma_softmax`: their online softmax, in a warp's registers;
- `mma_mask`: which keys each query row sees, found once per block;
- `mma_outputs`: a block's end: rows written, or a decode's warps combined;
- `mma_tiles`: their shared memory, and the copies that fill it;
- `producer`: the producer warpgroup that feeds the Hopper prefill's
  tiles, and the barriers it hands them over by;
- `merge`: combining the splits of a context;
- `op`: the entry point `attention_gpu`.
"""

from .op import attention_gpu
