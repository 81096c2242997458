"""Building a batch's paged-cache inputs (the contract: `mokv.contract`) with numpy.

Per replica a batch gets one set of tables, shared by every TP shard and every
leaf cache: `cache_lengths` (each request's `processed_length`), the
`lookup_table` (row b lists request b's page ids, null-padded to the most pages
any request needs this step, or to `ceil(max_cache_length / page_size)`), and
`max_lengths` (row i: most new tokens, longest context at step i; step 0 runs
the active tokens, later steps one token each). `device_inputs` pairs them
with each shard's block tensor.

The manager keeps every claimed request's page ids in a `BlockTable`, one
null-padded row per request, so a batch's lookup table is one fancy-indexing
gather (plus a mask when a request holds more pages than this step needs).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
from max.driver import Buffer, Device

from ..contract import PagedCacheInputs


@dataclass(frozen=True)
class BatchCharacteristics:
    """An upper bound on a batch's shape, for replaying a graph captured at that shape.

    When given to `runtime_inputs`, `max_lengths` row 0 reports these values
    instead of the batch's own (which must not exceed them).
    """

    batch_size: int
    max_prompt_length: int
    max_cache_valid_length: int


class BlockTable:
    """Page ids of every claimed request of one replica, one row each.

    Unused entries hold `null_page`, so a row can be read past its end. The
    table doubles its rows when every row is taken and its columns when a
    request outgrows them, so it stays as wide as the longest request so far.
    """

    def __init__(self, null_page: int, initial_rows: int, initial_cols: int = 64) -> None:
        self.null_page = null_page
        self._table = np.full((max(initial_rows, 1), initial_cols), null_page, dtype=np.uint32)
        self._free_rows = list(range(len(self._table) - 1, -1, -1))

    def _resize(self, rows: int, cols: int) -> None:
        grown = np.full((rows, cols), self.null_page, dtype=np.uint32)
        old_rows, old_cols = self._table.shape
        grown[:old_rows, :old_cols] = self._table
        self._table = grown

    def add_row(self) -> int:
        """A fresh all-null row."""
        if not self._free_rows:
            old_rows, cols = self._table.shape
            self._resize(2 * old_rows, cols)
            self._free_rows = list(range(2 * old_rows - 1, old_rows - 1, -1))
        return self._free_rows.pop()

    def drop_row(self, row: int, length: int) -> None:
        """Nulls the first `length` entries of `row` and recycles it."""
        self._table[row, :length] = self.null_page
        self._free_rows.append(row)

    def write(self, row: int, start: int, pages: list[int]) -> None:
        """Writes `pages` at `row[start:]`."""
        stop = start + len(pages)
        rows, cols = self._table.shape
        if stop > cols:
            self._resize(rows, max(stop, 2 * cols))
        self._table[row, start:stop] = pages

    def read(self, row: int, start: int, stop: int) -> list[int]:
        """`row[start:stop]` as ints."""
        return self._table[row, start:stop].tolist()

    def gather(self, rows: npt.NDArray[np.int64], width: int) -> npt.NDArray[np.uint32]:
        """A copy of the first `width` entries of each of `rows`."""
        if width > self._table.shape[1]:
            self._resize(self._table.shape[0], width)
        return self._table[rows, :width]


@dataclass(frozen=True)
class BatchTables:
    """One replica's per-batch tables, on the host."""

    cache_lengths: npt.NDArray[np.uint32]
    lookup_table: npt.NDArray[np.uint32]
    max_lengths: npt.NDArray[np.uint32]


def batch_tables(
    table: BlockTable,
    rows: npt.NDArray[np.int64],
    processed: npt.NDArray[np.int64],
    current: npt.NDArray[np.int64],
    held_pages: npt.NDArray[np.int64],
    request_ids: list,
    *,
    page_size: int,
    num_steps: int,
    max_cache_length: int | None,
    batch_characteristics: BatchCharacteristics | None,
) -> BatchTables:
    """Builds one replica's tables for a batch.

    Args:
        table: The replica's block table.
        rows, processed, current, held_pages: Per batch entry: table row,
            `processed_length`, `current_length`, pages the request holds.
        request_ids: Per batch entry, for error messages.
        page_size: Tokens per page.
        num_steps: Decode steps the graph runs on these inputs (>= 1).
        max_cache_length: Sizes the lookup table to this many tokens.
        batch_characteristics: Upper bounds reported in `max_lengths`.

    Raises:
        ValueError: A request holds fewer pages than this step writes to, or a
            size argument is smaller than the batch needs.
    """
    extra = num_steps - 1  # tokens written by the steps after the first
    needed = (current + (extra + page_size - 1)) // page_size
    spare = held_pages - needed
    if spare.min(initial=0) < 0:
        i = int(np.flatnonzero(spare < 0)[0])
        raise ValueError(
            f"request {request_ids[i]!r} holds {int(held_pages[i])} pages but needs "
            f"{int(needed[i])} for {int(current[i]) + extra} tokens: call alloc first"
        )
    batch = len(rows)
    max_context = int(current.max(initial=0))
    max_new = int((current - processed).max(initial=0))
    width = (max_context + extra + page_size - 1) // page_size if batch else 0
    if max_cache_length is not None:
        fixed = -(-max_cache_length // page_size)
        if fixed < width:
            raise ValueError(
                f"max_cache_length={max_cache_length} gives {fixed} pages, but the batch needs {width}"
            )
        width = fixed
    lookup = table.gather(rows, width)
    if spare.max(initial=0) > 0:  # rows are null past each request's pages already
        lookup[np.arange(width) >= needed[:, None]] = table.null_page

    if batch_characteristics is not None:
        bc = batch_characteristics
        if batch > bc.batch_size or max_new > bc.max_prompt_length or max_context > bc.max_cache_valid_length:
            raise ValueError(f"batch (size {batch}, {max_new} new tokens, context {max_context}) exceeds {bc}")
        max_new, max_context = bc.max_prompt_length, bc.max_cache_valid_length
    later = 1 if batch else 0  # each later step runs one token per request
    max_lengths = np.array(
        [(max_new, max_context)] + [(later, max_context + i * later) for i in range(1, num_steps)],
        dtype=np.uint32,
    )
    return BatchTables(processed.astype(np.uint32), lookup, max_lengths)


def device_inputs(tables: BatchTables, blocks: list[Buffer], devices: list[Device]) -> list[PagedCacheInputs[Buffer]]:
    """One `PagedCacheInputs` per TP shard: its block tensor and the batch's
    tables (copied to the shard's device, `max_lengths` staying on the host)."""
    cache_lengths = Buffer.from_numpy(tables.cache_lengths)
    lookup_table = Buffer.from_numpy(tables.lookup_table)
    max_lengths = Buffer.from_numpy(tables.max_lengths)
    return [
        PagedCacheInputs(
            blocks=shard_blocks,
            cache_lengths=cache_lengths if device.is_host else cache_lengths.to(device),
            lookup_table=lookup_table if device.is_host else lookup_table.to(device),
            max_lengths=max_lengths,
        )
        for shard_blocks, device in zip(blocks, devices, strict=True)
    ]
