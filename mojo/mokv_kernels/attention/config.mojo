"""Sizes the attention kernels are tuned with: the float32 vector width, the
context tile, the register blocks of the prefill products, and when a context
is split over several work items."""

from std.sys import simd_width_of
from std.utils.numerics import neg_inf


comptime W = simd_width_of[DType.float32]()
"""Float32 lanes per vector: 4 (NEON), 8 (AVX2) or 16 (AVX-512)."""
comptime HEAD_DIM_MULTIPLE = 16
"""What head_dim (and a quantized cache's granularity) must be a multiple of:
the widest float32 vector of any CPU we build for, so a model that runs on one
machine runs on every other, not only where the vectors happen to be narrow."""
comptime Vec = SIMD[DType.float32, W]
comptime TILE = 32
"""Context tokens per tile."""
comptime QK_VECS = 4 if W >= 16 else 2
"""Vectors of query rows per register block of the prefill score product."""
comptime QK_TOKENS = 4
"""Context tokens per register block of the prefill score product."""
comptime PV_ROWS = 4
"""Query rows per register block of the prefill value product."""
comptime PV_VECS = 4 if W >= 16 else 2
"""Vectors of head_dim per register block of the prefill value product."""
comptime PREFILL_ROWS = 128
"""Target query rows (tokens x heads of one KV head) per prefill item; a
multiple of `QK_VECS * W`."""
comptime SKEW = 16
"""Floats added to the row stride of scratch matrices. Power-of-two strides
(128 floats = 512 B) put a tile's rows into a few L1 sets, where they evict one
another between register blocks; one more cache line per row spreads them."""
comptime MIN_SPLIT = 512
"""Fewest context tokens worth a split of their own."""
comptime SPLITS_PER_WORKER = 4
comptime PARALLEL_MIN_PRODUCTS = 262144
"""Multiply-adds (scores and values) below which a call runs on the calling
thread alone: about as much work as waking a worker can cost inside a graph."""
comptime LOG2E: Float32 = 1.4426950408889634
comptime NEG_INF = neg_inf[DType.float32]()
