"""Compiling each test graph once per session, on first use.

A family of graphs (one per dtype and layout, say) is compiled together: MAX pays about
20 s for any graph before its kernels, and a `GraphGroup` pays it once for the family
(`docs/suite-time.md`). The GPU families compile so too, which no GPU run has done yet
(`tests/gpu/README.md`, "The prepared command")."""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable

from max.engine import InferenceSession, Model
from max.graph import Graph

from mokv.graph import GraphGroup

Key = tuple[Hashable, ...]


def compiled_together(
    session: InferenceSession, build: Callable[..., Graph], keys: Iterable[Key]
) -> Callable[..., Model]:
    """`get(*key)`: the graph `build(*key, group=group)`. The first call builds the graph
    of every key in `keys` into one `GraphGroup` and compiles them in one compile; later
    calls return the same models. A key outside `keys` raises `KeyError` naming it."""
    family = list(keys)
    models: dict[Key, Model] = {}

    def get(*key: Hashable) -> Model:
        if key not in family:
            raise KeyError(f"graph key {key!r} is not in this family: {family!r}")
        if not models:
            group = GraphGroup()
            names = {k: build(*k, group=group).name for k in family}
            loaded = group.load(session)
            models.update({k: loaded[name] for k, name in names.items()})
        return models[key]

    return get
