"""What the bad-input tests share: a refused call as a `Case`, and the values
and small params they are built from.

Every public entry point is tried as a hostile or careless caller would: each
case is a call that must be refused: it raises the documented exception type,
and the message names the bad value (the managers' tests also check that the
whole observable state is unchanged, `tests.support.manager_state`).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
from max.dtype import DType

from mokv import KVCacheParams, TextContext

HUGE = 10**15
NAN = float("nan")
INF = float("inf")

BASE = {"dtype": DType.float32, "n_kv_heads": 2, "head_dim": 8, "num_layers": 2}
"""A small cache's fields; `KVCacheParams(**BASE)` is valid."""
P = KVCacheParams(**BASE, page_size=4)


@dataclass(frozen=True)
class Case:
    """A call that must raise `error` with `names` (a value's repr) in its message."""

    name: str
    call: Callable[..., Any]
    error: type[BaseException]
    names: str


def cases(*rows: tuple) -> list:
    """`Case(*row)` for each row, as pytest params named by the row's first field."""
    return [pytest.param(Case(*row), id=row[0]) for row in rows]


def raises_naming(case: Case, *args: Any) -> None:
    """Calls `case.call(*args)`, which must raise `case.error` naming `case.names`."""
    with pytest.raises(case.error, match=re.escape(case.names)):
        case.call(*args)


def ctx(request_id: Any, tokens: Any) -> TextContext:
    """A context with `tokens` as its prompt (any request id, even a bad one)."""
    return TextContext(request_id, np.asarray(tokens, np.int64))


def second(rid: str, tokens: Any) -> TextContext:
    """Another context object under a live request id."""
    return ctx(rid, tokens)
