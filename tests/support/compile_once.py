"""Compiling each distinct test graph once per session, on first use."""

from __future__ import annotations

from collections.abc import Callable, Hashable

from max.engine import InferenceSession, Model
from max.graph import Graph


def compiled_per_key(session: InferenceSession, build: Callable[..., Graph]) -> Callable[..., Model]:
    """`get(*key)`: the graph `build(*key)` compiled into `session` the first
    time that key is asked for, and the same model every time after."""
    models: dict[tuple[Hashable, ...], Model] = {}

    def get(*key: Hashable) -> Model:
        if key not in models:
            models[key] = session.load(build(*key))
        return models[key]

    return get
