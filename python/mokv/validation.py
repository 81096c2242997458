"""Argument checks shared by every public entry point, with errors that name the value.

The rules, in one place so every call applies them the same way:

* A count, size or index is an `int` (numpy integers too). `bool` is refused
  although it is an `int` subclass, and so are floats, even `1.0`: a float
  where a count belongs is a caller's bug, not a value to round. Type errors
  raise `TypeError`, range errors `ValueError`; both messages name the
  parameter and the bad value.
* A request id is a `str`, an `int` (not `bool`, whose `True` would be the
  same dictionary key as `1`), a `uuid.UUID` or MAX's `RequestID`: values
  that compare and hash by content. Floats (NaN is not equal to itself),
  None and containers are refused.
* A size that would not fit in a device's free memory is refused with a
  `ValueError` naming the size before anything is allocated; an allocation
  that still fails raises `MemoryError` with the same details.
"""

from __future__ import annotations

import math
import operator
import uuid
from collections.abc import Callable, Hashable, Iterable
from typing import TypeVar

import numpy as np
from max.driver import Device

T = TypeVar("T")


def _describe(value: object) -> str:
    return f"{value!r} ({type(value).__name__})"


def check_int(name: str, value: object, *, minimum: int | None = None, maximum: int | None = None) -> int:
    """`value` as an `int` in `[minimum, maximum]`.

    Raises:
        TypeError: `value` is no integer (a `bool`, a float, a string, None).
        ValueError: `value` is out of range.
    """
    if type(value) is not int:
        if isinstance(value, (bool, np.bool_)) or not hasattr(type(value), "__index__"):
            raise TypeError(f"{name} must be an integer, got {_describe(value)}")
        value = operator.index(value)  # type: ignore[call-overload]
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise ValueError(f"{name} must be <= {maximum}, got {value}")
    return value  # type: ignore[return-value]


def check_bool(name: str, value: object) -> bool:
    """`value`, which must be a `bool` (a string such as "false" is refused).

    Raises:
        TypeError: `value` is no `bool`.
    """
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be a bool, got {_describe(value)}")
    return bool(value)


def check_finite(name: str, value: object, *, positive: bool = False) -> float:
    """`value` as a finite real number (and > 0 when `positive`).

    Raises:
        TypeError: `value` is no real number (a `bool` or a string, say).
        ValueError: `value` is NaN, infinite, or not positive when it must be.
    """
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise TypeError(f"{name} must be a real number, got {_describe(value)}")
    number = float(value)
    if not math.isfinite(number) or (positive and number <= 0):
        raise ValueError(f"{name} must be a finite{' positive' if positive else ''} number, got {value!r}")
    return number


_REQUEST_ID_TYPES: set[type] = {str, int, uuid.UUID}
"""Types accepted as request ids so far (subclasses and MAX's `RequestID` join on first sight)."""


def _is_max_request_id(cls: type) -> bool:
    try:
        from max.pipelines.modeling.types import RequestID
    except ImportError:
        return False
    return issubclass(cls, RequestID)


def check_request_id(request_id: object) -> None:
    """Refuses request ids of an unsupported type.

    Raises:
        TypeError: `request_id` is no `str`, `int` (a `bool` is refused),
            `uuid.UUID` or MAX `RequestID`.
    """
    cls = type(request_id)
    if cls in _REQUEST_ID_TYPES:
        return
    if isinstance(request_id, (bool, np.bool_)) or not (
        isinstance(request_id, (str, int, np.integer, uuid.UUID)) or _is_max_request_id(cls)
    ):
        raise TypeError(f"request ids must be str, int, uuid.UUID or MAX's RequestID, got {_describe(request_id)}")
    _REQUEST_ID_TYPES.add(cls)


def check_unique(what: str, ids: Iterable[Hashable]) -> None:
    """Refuses a batch naming the same request (or sequence) twice.

    Raises:
        ValueError: The first repeated id, by name.
    """
    seen: set[Hashable] = set()
    for item in ids:
        if item in seen:
            raise ValueError(f"{what} {item!r} appears twice in one batch")
        seen.add(item)


def check_sequence(name: str, value: object) -> None:
    """Refuses a batch argument that is no list or tuple (a string, a context, None).

    Raises:
        TypeError: `value` is not a list, tuple or 1-D array.
    """
    if not isinstance(value, (list, tuple)) and not (isinstance(value, np.ndarray) and value.ndim == 1):
        raise TypeError(f"{name} must be a list or tuple, got {_describe(value)}")


def _format_bytes(n: int) -> str:
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if size < 1024 or unit == "PiB":
            return f"{size:.1f} {unit}" if unit != "B" else f"{n} B"
        size /= 1024
    raise AssertionError("unreachable")


def free_memory(device: Device) -> int:
    """Bytes the device reports free (for a CPU, the host's available memory)."""
    return int(device.stats["free_memory"])


def check_fits(what: str, nbytes: int, device: Device) -> None:
    """Refuses an allocation of `nbytes` on `device` larger than its free memory.

    Args:
        what: The parameters that set the size, for example
            `"total_num_pages=1000000000000000"`.

    Raises:
        ValueError: The size exceeds the device's free memory.
    """
    available = free_memory(device)
    if nbytes > available:
        raise ValueError(
            f"{what} needs {_format_bytes(nbytes)} on {device.label}:{device.id}, "
            f"which has {_format_bytes(available)} free"
        )


def allocate(what: str, nbytes: int, device: Device, make: Callable[[], T]) -> T:
    """`make()`, after `check_fits`, finished before it returns; an allocation
    that fails anyway raises `MemoryError` naming `what` and the size instead
    of the driver's bare message.

    MAX 26.7 fills `Buffer.zeros` asynchronously, even on the CPU: a kernel
    run right after the call races the fill, and measured here a 2048-token
    store into a fresh page tensor lost up to half its rows to zeros landing
    after it. So the device is synchronized before the buffer is handed out."""
    check_fits(what, nbytes, device)
    try:
        made = make()
        device.synchronize()
        return made
    except (MemoryError, ValueError) as error:
        if isinstance(error, ValueError) and "allocation failed" not in str(error).lower():
            raise
        raise MemoryError(
            f"{what}: allocating {_format_bytes(nbytes)} on {device.label}:{device.id} failed "
            f"({_format_bytes(free_memory(device))} free)"
        ) from error
