"""The Hadamard rotation of keys and queries that a quantized cache can store
keys in (`KVCacheQuantConfig.rotate_keys`).

Attention scores are dot products, which an orthonormal matrix H leaves
unchanged: (q H) . (k H) = q . k. A head's keys often have a few channels far
larger than the rest; one scale per head then spends most of the 8-bit codes'
range on those channels and rounds the others coarsely. After H (whose
entries are all +-1/sqrt(head_dim)), each element mixes every channel, the
large ones spread over the head, and the same 8 bits keep more of every score.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
from max.dtype import DType
from max.graph import TensorValue, ops


def hadamard(n: int) -> npt.NDArray[np.float32]:
    """The `n x n` orthonormal Hadamard matrix (Sylvester's construction:
    symmetric, its own inverse) for `n` a power of two."""
    if n < 1 or n & (n - 1):
        raise ValueError(f"a Hadamard matrix needs a power of two size, got {n}")
    h = np.ones((1, 1), np.float32)
    while len(h) < n:
        h = np.block([[h, h], [h, -h]])
    return h / np.float32(np.sqrt(n))


def rotate_heads(x: TensorValue) -> TensorValue:
    """`x` `[tokens, heads, head_dim]` with each head's vector multiplied by
    `hadamard(head_dim)`, on `x`'s device and in its dtype (the product in float32)."""
    head_dim = int(x.shape[-1])
    matrix = ops.constant(hadamard(head_dim), DType.float32, x.device)
    rows = x if x.dtype == DType.float32 else ops.cast(x, DType.float32)
    rotated = rows @ matrix
    return rotated if x.dtype == DType.float32 else ops.cast(rotated, x.dtype)
