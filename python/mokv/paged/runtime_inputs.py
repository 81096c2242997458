"""Building a batch's paged-cache inputs (the contract: `mokv.contract`) with numpy.

Per replica a batch gets one set of tables, shared by every TP shard and every
leaf cache: `cache_lengths` (each request's `processed_length`), the
`lookup_table` (row b lists request b's page ids, null-padded to the most pages
any request needs this step, or to `ceil(max_cache_length / page_size)`), and
`max_lengths` (row i: most new tokens, longest context at step i; step 0 runs
the active tokens, later steps one token each). `device_inputs` pairs them
with each shard's block tensor (and scales tensor, when quantized).

The manager keeps every claimed request's page ids in a `BlockTable`, one
null-padded row per request, and checks a batch in one pass over its requests
that also finds the maxima; `InputStaging` then fills persistent host arrays:
the lookup table is one copy into them (a slice of the table when the batch's
rows are consecutive, else one `np.take`; plus a mask when a request holds
more pages than this step needs), and their `Buffer` views are reused: the
same `BatchTables` object for the same arrays and shape, refilled.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
from max.driver import Buffer, Device

from ..buffer import KVCacheBuffer
from ..contract import PagedCacheInputs
from ..validation import check_int

_UINT32_MAX = (1 << 32) - 1


@dataclass(frozen=True)
class BatchCharacteristics:
    """An upper bound on a batch's shape, for replaying a graph captured at that shape.

    When given to `runtime_inputs`, `max_lengths` row 0 reports these values
    instead of the batch's own (which must not exceed them).
    """

    batch_size: int
    max_prompt_length: int
    max_cache_valid_length: int

    def __post_init__(self) -> None:
        for name in ("batch_size", "max_prompt_length", "max_cache_valid_length"):
            check_int(name, getattr(self, name), minimum=0, maximum=_UINT32_MAX)


TableRows = slice | npt.NDArray[np.intp]
"""Block-table rows of a batch's requests, in batch order: a slice when they are
consecutive (copied in one block, several times faster than a gather)."""


def table_rows(rows: list[int]) -> TableRows:
    """`rows` in the form `BlockTable.gather_into` copies fastest."""
    if rows and rows[-1] - rows[0] == len(rows) - 1 and rows == list(range(rows[0], rows[-1] + 1)):
        return slice(rows[0], rows[-1] + 1)
    return np.array(rows, np.intp)


class BlockTable:
    """Page ids of every claimed request of one replica, one row each.

    Unused entries hold `null_page`, so a row can be read past its end. The
    table doubles its rows when every row is taken and its columns when a
    request outgrows them, so it stays as wide as the longest request so far.
    A new request takes the lowest free row: requests claimed together get
    consecutive rows, so their batch's lookup table is one slice copy.
    """

    def __init__(self, null_page: int, initial_rows: int, initial_cols: int = 64) -> None:
        self.null_page = null_page
        self._table = np.full((max(initial_rows, 1), initial_cols), null_page, dtype=np.uint32)
        self._free_rows = list(range(len(self._table)))  # a min-heap

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
            self._free_rows = list(range(old_rows, 2 * old_rows))
        return heapq.heappop(self._free_rows)

    def drop_row(self, row: int, length: int) -> None:
        """Nulls the first `length` entries of `row` and recycles it."""
        self._table[row, :length] = self.null_page
        heapq.heappush(self._free_rows, row)

    def write(self, row: int, start: int, pages: list[int]) -> None:
        """Writes `pages` at `row[start:]`."""
        stop = start + len(pages)
        rows, cols = self._table.shape
        if stop > cols:
            self._resize(rows, max(stop, 2 * cols))
        self._table[row, start:stop] = pages

    def set(self, row: int, col: int, page: int) -> None:
        """Writes one page id at `row[col]` (a decode step's new page)."""
        if col >= self._table.shape[1]:
            self._resize(self._table.shape[0], 2 * self._table.shape[1])
        self._table[row, col] = page

    def read_cells(self, rows: list[int], cols: list[int]) -> list[int]:
        """`row[col]` for each row of `rows` (with its col), as ints."""
        return self._table[rows, cols].tolist()

    def read(self, row: int, start: int, stop: int) -> list[int]:
        """`row[start:stop]` as ints."""
        return self._table[row, start:stop].tolist()

    def gather(self, rows: list[int], width: int) -> npt.NDArray[np.uint32]:
        """A copy of the first `width` entries of each of `rows`."""
        out = np.empty((len(rows), width), np.uint32)
        self.gather_into(table_rows(rows), out)
        return out

    def gather_into(self, rows: TableRows, out: npt.NDArray[np.uint32]) -> None:
        """Copies the first `out.shape[1]` entries of each of `rows` into `out`."""
        width = out.shape[1]
        if width > self._table.shape[1]:
            self._resize(self._table.shape[0], width)
        if type(rows) is slice:
            out[...] = self._table[rows, :width]
        else:
            np.take(self._table[:, :width], rows, axis=0, out=out)


@dataclass(frozen=True, eq=False)
class BatchTables:
    """One replica's per-batch tables, on the host, as `Buffer`s aliasing `InputStaging`'s arrays.

    `InputStaging` hands out the same object for the same arrays and shape,
    refilled: equal by identity, so callers can key what they derive from it."""

    cache_lengths: Buffer
    lookup_table: Buffer
    max_lengths: Buffer


_MAX_SHAPES = 64
"""Table shapes one set keeps views of (shapes change as contexts grow; old ones are dropped)."""


class _Arrays:
    """One set of flat uint32 host arrays, grown (doubling) as batches need,
    and the tables already made of them, by shape."""

    def __init__(self) -> None:
        self.lengths = np.zeros(0, np.uint32)
        self.lookup = np.zeros(0, np.uint32)
        self.max_lengths = np.zeros(0, np.uint32)
        self.made: dict[tuple[int, int, int], tuple[np.ndarray, np.ndarray, np.ndarray, BatchTables]] = {}
        """By (batch, width, num_steps): contiguous views of the three arrays
        and the `BatchTables` of `Buffer`s aliasing them."""

    def tables(self, batch: int, width: int, num_steps: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, BatchTables]:
        """Views shaped `[batch]`, `[batch, width]`, `[num_steps, 2]`, and their `BatchTables`."""
        key = (batch, width, num_steps)
        made = self.made.get(key)
        if made is not None:
            return made
        for name, size in (("lengths", batch), ("lookup", batch * width), ("max_lengths", 2 * num_steps)):
            flat = getattr(self, name)
            if size > flat.size:
                setattr(self, name, np.zeros(max(size, 2 * flat.size), np.uint32))
                self.made.clear()  # views of the old array stay valid while their holders keep them
        if len(self.made) >= _MAX_SHAPES:
            self.made.clear()
        lengths = self.lengths[:batch]
        lookup = self.lookup[: batch * width].reshape(batch, width)
        max_lengths = self.max_lengths[: 2 * num_steps].reshape(num_steps, 2)
        buffers = BatchTables(Buffer.from_numpy(lengths), Buffer.from_numpy(lookup), Buffer.from_numpy(max_lengths))
        made = self.made[key] = (lengths, lookup, max_lengths, buffers)
        return made


class InputStaging:
    """Where one replica's per-batch tables are built, reused from call to call.

    Two sets of host arrays are used in turn, and each set keeps the `Buffer`
    views it has handed out, so a steady decode loop allocates nothing: the
    tables of one `runtime_inputs` call stay intact through the next call
    (which writes the other set) and are overwritten by the call after that.
    The contract (`mokv.contract`, "Lifetimes") promises callers less: run the
    graph before the next call.
    """

    def __init__(self, null_page: int) -> None:
        self.null_page = null_page
        self._sets = (_Arrays(), _Arrays())
        self._turn = 0

    def build(
        self,
        table: BlockTable,
        rows: TableRows,
        cache_lengths: list[int],
        needed: list[int] | None,
        width: int,
        max_new: int,
        max_context: int,
        num_steps: int,
    ) -> BatchTables:
        """Fills the next set's arrays for a batch checked by the caller.

        Args:
            table: The replica's block table.
            rows: The batch entries' rows of `table`, in batch order.
            cache_lengths: Per batch entry, its `processed_length`.
            needed: Per batch entry, the pages this step reads, when some
                entry holds more (the rest of its row is masked to the null
                page); None when every entry holds exactly what it needs.
            width: The lookup table's width in pages.
            max_new, max_context: `max_lengths` row 0.
            num_steps: Rows of `max_lengths` (later steps run one token each).
        """
        arrays = self._sets[self._turn]
        self._turn ^= 1
        batch = len(cache_lengths)
        lengths, lookup, max_lengths, tables = arrays.tables(batch, width, num_steps)
        lengths[:] = cache_lengths
        table.gather_into(rows, lookup)
        if needed is not None:
            lookup[np.arange(width) >= np.asarray(needed)[:, None]] = self.null_page
        max_lengths[0] = (max_new, max_context)
        if num_steps > 1:
            later = 1 if batch else 0  # each later step runs one token per request
            max_lengths[1:, 0] = later
            max_lengths[1:, 1] = max_context + later * np.arange(1, num_steps)
        return tables


def device_inputs(tables: BatchTables, buffer: KVCacheBuffer, devices: list[Device]) -> list[PagedCacheInputs[Buffer]]:
    """One `PagedCacheInputs` per TP shard: its block tensor (and, for a
    quantized cache, its scales tensor) and the batch's tables (copied to the
    shard's device, `max_lengths` staying on the host)."""
    return [
        PagedCacheInputs(
            blocks=blocks,
            cache_lengths=tables.cache_lengths if device.is_host else tables.cache_lengths.to(device),
            lookup_table=tables.lookup_table if device.is_host else tables.lookup_table.to(device),
            max_lengths=tables.max_lengths,
            scales=scales,
        )
        for blocks, scales, device in zip(buffer.graph_values, buffer.shard_scales, devices, strict=True)
    ]
