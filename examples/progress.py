"""Progress for set-up steps that take a while (a first compile takes minutes): the step is
announced, a line says how long it has been running every `interval` seconds, and its
duration is reported when it ends."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager


@contextmanager
def ticking(label: str, log: Callable[[str], None], interval: float = 15.0) -> Iterator[None]:
    """Runs the body while reporting `label`'s progress through `log`."""
    started = time.perf_counter()
    done = threading.Event()

    def tick() -> None:
        while not done.wait(interval):
            log(f"  ... {label}: {time.perf_counter() - started:.0f} s so far")

    log(f"{label}...")
    ticker = threading.Thread(target=tick, daemon=True)
    ticker.start()
    try:
        yield
    finally:
        done.set()
        ticker.join()
    log(f"{label}: done in {time.perf_counter() - started:.1f} s")
