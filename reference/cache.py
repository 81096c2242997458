"""A numpy model of both cache layouts: where each token's K/V row lives.

Independent of the Mojo code: it indexes the 6-D block tensor directly, one
token at a time, so it is slow and obviously right.
"""

from __future__ import annotations

import numpy as np


def block_of(lookup_table: np.ndarray, row: int, pos: int, block_len: int) -> tuple[int, int]:
    """(block id, offset in block) of token `pos` of batch row `row`; a 1-D
    lookup table is the continuous layout (one slot per row)."""
    if lookup_table.ndim == 1:
        return int(lookup_table[row]), pos
    return int(lookup_table[row, pos // block_len]), pos % block_len


def store(
    blocks: np.ndarray,
    layer: int,
    keys: np.ndarray,
    values: np.ndarray,
    row_offsets: np.ndarray,
    cache_lengths: np.ndarray,
    lookup_table: np.ndarray,
) -> None:
    """Writes a ragged batch's new K/V into `blocks` `[blocks, 2, layers, block_len, H, D]`."""
    block_len = blocks.shape[3]
    for row in range(len(cache_lengths)):
        for i in range(row_offsets[row], row_offsets[row + 1]):
            pos = int(cache_lengths[row]) + i - int(row_offsets[row])
            block, offset = block_of(lookup_table, row, pos, block_len)
            blocks[block, 0, layer, offset] = keys[i]
            blocks[block, 1, layer, offset] = values[i]


def gather(
    blocks: np.ndarray,
    layer: int,
    kv_idx: int,
    lookup_table: np.ndarray,
    rows: np.ndarray,
    positions: np.ndarray,
) -> np.ndarray:
    """Token rows `(rows[i], positions[i])` of one layer's K or V."""
    block_len = blocks.shape[3]
    out = np.empty((len(rows), *blocks.shape[4:]), blocks.dtype)
    for i, (row, pos) in enumerate(zip(rows, positions, strict=True)):
        block, offset = block_of(lookup_table, int(row), int(pos), block_len)
        out[i] = blocks[block, kv_idx, layer, offset]
    return out
