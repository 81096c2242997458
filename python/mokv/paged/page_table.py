"""One replica's page table: the page ids of every claimed request, one row each.

Runtime inputs gather a batch's lookup table from it (`runtime_inputs`), and
the replica reads a request's pages from it (`replica.Replica.pages_of`).
"""

from __future__ import annotations

import heapq

import numpy as np
import numpy.typing as npt

TableRows = slice | npt.NDArray[np.intp]
"""Page-table rows of a batch's requests, in batch order: a slice when they are
consecutive (copied in one block of memory, several times faster than a gather)."""


def table_rows(rows: list[int]) -> TableRows:
    """`rows` in the form `PageTable.gather_into` copies fastest."""
    if rows and rows[-1] - rows[0] == len(rows) - 1 and rows == list(range(rows[0], rows[-1] + 1)):
        return slice(rows[0], rows[-1] + 1)
    return np.array(rows, np.intp)


class PageTable:
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
