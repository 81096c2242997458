"""An 8-bit KV cache modelled for the numpy forward (`numpy_llama_logits(..., kv_store=...)`).

What mokv's quantized cache gives attention back, built from `quant`'s numpy formats rather
than the kernels: one scale per token and KV head, and keys rotated by the orthonormal
Hadamard matrix before they are stored, as `KVCacheQuantConfig(rotate_keys=True)` (the
pipeline's default for 8-bit KV) has the graph do. The forward holds heads in llama.cpp's
channel order, the graph in the Hugging Face one, so the rotation is taken in the graph's.
"""

from __future__ import annotations

import numpy as np

from . import quant
from .numpy_llama import KVStore, llama_cpp_permute

PARTS = ("keys", "values", "both")


def sylvester_hadamard(n: int) -> np.ndarray:
    """The orthonormal `n x n` Hadamard matrix (`n` a power of two), built here rather than
    taken from `mokv.graph.hadamard` so that the model shares no code with what it checks."""
    h = np.ones((1, 1))
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return h / np.sqrt(n)


def round_trip(x: np.ndarray, fmt: str) -> np.ndarray:
    """`x [T, heads, D]` as a cache of `fmt` with one scale per token and head returns it."""
    codes, scales = quant.quantize(x, x.shape[-1], fmt)
    return quant.dequantize(codes, scales, fmt)


def eight_bit_store(fmt: str, head_dim: int, part: str = "both") -> KVStore:
    """A `kv_store` keeping `part` (keys, values or both) of every layer's KV in `fmt`."""
    if part not in PARTS:
        raise ValueError(f"part must be one of {', '.join(PARTS)}, got {part!r}")
    graph_channel = llama_cpp_permute(np.arange(head_dim)[:, None], 1)[:, 0]  # of each llama.cpp channel
    rotation = sylvester_hadamard(head_dim)[:, graph_channel]  # llama.cpp's order in, rotated out

    def store(layer: int, keys: np.ndarray, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        if part != "values":
            keys = round_trip(keys @ rotation.T, fmt) @ rotation
        if part != "keys":
            values = round_trip(values, fmt)
        return keys, values

    return store
