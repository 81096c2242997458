"""PageTable: the per-request page rows runtime inputs are gathered from."""

from __future__ import annotations

import numpy as np

from mokv.paged.page_table import PageTable

NULL = 99


def test_rows_and_columns_grow_without_losing_pages() -> None:
    table = PageTable(NULL, initial_rows=2, initial_cols=4)
    a, b = table.add_row(), table.add_row()
    table.write(a, 0, [1, 2, 3])
    table.write(b, 0, [7])
    c = table.add_row()  # doubles the rows
    table.write(c, 0, list(range(10, 19)))  # 9 pages: doubles the columns past 4
    assert (a, b, c) == (0, 1, 2)
    assert table.read(a, 0, 3) == [1, 2, 3] and table.read(b, 0, 2) == [7, NULL]
    assert table.read(c, 0, 9) == list(range(10, 19))
    gathered = table.gather([c, a], 20)  # wider than the table: padded with null
    assert gathered.shape == (2, 20) and gathered.dtype == np.uint32
    assert gathered[0].tolist() == list(range(10, 19)) + [NULL] * 11
    assert gathered[1].tolist() == [1, 2, 3] + [NULL] * 17
    consecutive = table.gather([a, b, c], 3)  # copied as one slice of rows
    assert consecutive.tolist() == [[1, 2, 3], [7, NULL, NULL], [10, 11, 12]]


def test_dropped_rows_come_back_null() -> None:
    table = PageTable(NULL, initial_rows=1, initial_cols=4)
    row = table.add_row()
    table.write(row, 0, [5, 6])
    table.drop_row(row, 2)
    again = table.add_row()
    assert again == row and table.read(again, 0, 4) == [NULL] * 4


def test_a_new_request_takes_the_lowest_free_row() -> None:
    table = PageTable(NULL, initial_rows=4, initial_cols=2)
    rows = [table.add_row() for _ in range(4)]
    for row in rows:  # released in batch order, as a finished batch is
        table.drop_row(row, 0)
    again = [table.add_row() for _ in range(4)]
    assert again == [0, 1, 2, 3]  # consecutive, so the next batch's gather is one slice
    table.drop_row(2, 0)
    table.drop_row(0, 0)
    assert [table.add_row(), table.add_row(), table.add_row()] == [0, 2, 4]
