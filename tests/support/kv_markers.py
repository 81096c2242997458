"""A stand-in for the model in property tests: a marker per token, written into
the page (or slot) tensor where the model would store that token's keys and values.

A token's marker is a function of the whole prefix up to it (a running sum of
position-weighted tokens, mod 2**64), split into four 16-bit chunks stored as
exact float32 values in the K and V rows of a one-head, head_dim-2 cache. A
request whose pages hold the right marker for every processed token holds KV
computed for exactly its own prefix, whoever wrote it: itself, a request it
shares a cached prefix with, or a host-tier restore.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

_WEIGHTS = np.random.default_rng(0x6B76).integers(1, 1 << 63, size=1 << 14, dtype=np.uint64) | np.uint64(1)


def markers(tokens: npt.NDArray[np.integer]) -> npt.NDArray[np.float32]:
    """`[len(tokens), 2, 2]` markers: (K, V) x head_dim 2 per token."""
    n = len(tokens)
    t = (np.asarray(tokens, np.int64).view(np.uint64) + np.uint64(1)) * _WEIGHTS[:n]
    prefix = np.cumsum(t, dtype=np.uint64)
    chunks = (prefix[:, None] >> np.array([0, 16, 32, 48], np.uint64)) & np.uint64(0xFFFF)
    return chunks.astype(np.float32).reshape(n, 2, 2)


def write(tensor: np.ndarray, pages: np.ndarray, offsets: np.ndarray, values: np.ndarray) -> None:
    """Stores `values[i]` at token `offsets[i]` of page (or slot) `pages[i]` of
    the cache's `tensor` (layer 0, head 0)."""
    tensor[pages, :, 0, offsets, 0, :] = values


def read(tensor: np.ndarray, pages: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """The markers stored at those tokens."""
    return tensor[pages, :, 0, offsets, 0, :]
