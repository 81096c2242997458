"""The references some benchmarks run beside mokv (MAX's own KV cache manager, attention
kernels and cache, in the `mokv_reference` package), imported when such a benchmark runs
rather than when the `mokv` command starts.

`mokv_reference` is a distribution of its own (`reference/` in a checkout), for tests and
benchmarks only: mokv's wheel does not ship it, and MAX's manager needs `max[serve]` besides.
Where it is missing, the benchmark stops with a message that says how to get it, and every
other command works as before."""

from __future__ import annotations

import importlib
from types import ModuleType

import click

INSTALL_HINT = (
    "From a checkout of mokv, `make setup` installs it; "
    "otherwise `pip install -e <checkout>/reference 'max[serve]==26.7.0'`."
)


def reference(module: str, purpose: str) -> ModuleType:
    """`mokv_reference.<module>`; where it (or what it imports, such as `max[serve]`) cannot be
    imported, a click error that names `purpose` (what the benchmark needs it for), the
    missing module and how to install it."""
    try:
        return importlib.import_module(f"mokv_reference.{module}")
    except ModuleNotFoundError as error:
        raise click.ClickException(
            f"{purpose}: it comes from mokv's reference package (mokv_reference), which is not part of "
            f"mokv's wheel and could not be imported here ({error}). {INSTALL_HINT}"
        ) from error
