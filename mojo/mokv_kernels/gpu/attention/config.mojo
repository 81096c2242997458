"""Sizes and constants every GPU attention kernel shares: block shape, the
decode tile's rows, the base-2 softmax's constants, and when the context is
split over several blocks (split-K)."""

from std.utils.numerics import neg_inf

from ..warp import WARP

comptime BLOCK_THREADS = 128
"""Threads of an attention block: four warps."""
comptime WARPS = BLOCK_THREADS // WARP
comptime DECODE_ROWS = 8
"""Query rows of a decode block: one token times a GQA group of up to 8."""
comptime LOG2E: Float32 = 1.4426950408889634
"""Scores are scaled by `scale * log2(e)`, so the softmax runs on `exp2`."""
comptime NEG_INF = neg_inf[DType.float32]()
comptime QUANTIZED_CHUNK = 16
"""Codes a kernel reads at once (16 bytes): what a quantized cache's
granularity must be a multiple of, so a read shares one scale."""
comptime MIN_SPLIT_TOKENS = 256
"""Fewest context tokens worth a split of their own."""
comptime MAX_SPLITS = 128
"""Most splits of one context: the merge reads one split per thread (of
128). As many as 128 let a decode whose blocks take four or eight KV heads
fill an H200 at batch 1 (2 or 1 blocks a split); the default's blocks of
one head take at most 49 splits there (`plan.soonest_splits`)."""
