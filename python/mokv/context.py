"""A request's tokens and how many of them already have KV in the cache.

Two things live here:

* `CacheContext`, the protocol that says exactly what a KV cache manager reads
  and writes of a request's context, and `cache_context()`, which adapts any
  supported context type to it: mokv's own `TextContext` as it is, MAX's
  `max.pipelines.context.TextContext` (token state on `ctx.tokens`, a
  `TokenBuffer`) through `MaxTextContextAdapter`.
* `TextContext`, mokv's small context for generation loops and tests:

    tokens:   [ processed (KV cached) | active (run this step) ]
              0          processed_length                current_length

  Tokens live in one growable int64 array so appending a generated token is
  O(1) amortised and `tokens` is a view, never a copy.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any, Protocol, runtime_checkable

import numpy as np
import numpy.typing as npt


@runtime_checkable
class CacheContext(Protocol):
    """What a KV cache manager reads and writes of a request's context.

    Reads: `request_id`; `tokens` (every token known so far: prompt, then
    generated); `processed_length` (tokens whose KV is in the cache);
    `active_length` (tokens the next step runs and writes KV for);
    `current_length` (`processed_length + active_length`, the end of the
    step's window); `cache_salt` (None, or a string such as a tenant id:
    requests share cached KV only with requests of the same salt, as vLLM's
    and MAX's `cache_salt`). Writes, on a prefix-cache hit only:
    `skip_processing(n)` moves the window's start past `n` cached tokens, and
    on a request's first admission `cached_prefix_length` records how many
    prompt tokens the cache served (0 on a miss), as MAX's own manager does.
    """

    @property
    def request_id(self) -> Hashable: ...

    @property
    def tokens(self) -> npt.NDArray[np.int64]: ...

    @property
    def processed_length(self) -> int: ...

    @property
    def active_length(self) -> int: ...

    @property
    def current_length(self) -> int: ...

    @property
    def cache_salt(self) -> str | None: ...

    cached_prefix_length: int | None

    def skip_processing(self, n: int) -> None: ...


class TextContext:
    """Token bookkeeping for one request (implements `CacheContext` itself).

    Args:
        request_id: Unique id the cache manager files the request under.
        tokens: The prompt, a 1-D integer array (copied).
        max_length: Most tokens the request may ever hold, or None for no limit.
        cache_salt: Isolates the request's cached KV: it shares cached pages
            only with requests of the same salt (None shares with unsalted ones).
    """

    __slots__ = (
        "_buf",
        "_readonly",
        "cache_salt",
        "cached_prefix_length",
        "current_length",
        "max_length",
        "processed_length",
        "request_id",
    )

    def __init__(
        self,
        request_id: Hashable,
        tokens: npt.ArrayLike,
        max_length: int | None = None,
        cache_salt: str | None = None,
    ) -> None:
        prompt = np.asarray(tokens)
        if prompt.ndim != 1 or prompt.size == 0:
            raise ValueError(f"tokens must be a non-empty 1-D array, got shape {prompt.shape}")
        if not np.issubdtype(prompt.dtype, np.integer):
            raise TypeError(f"tokens must be integers, got dtype {prompt.dtype}")
        if max_length is not None and prompt.size > max_length:
            raise ValueError(f"prompt of {prompt.size} tokens exceeds max_length={max_length}")
        if cache_salt is not None and not isinstance(cache_salt, str):
            raise TypeError(f"cache_salt must be a string or None, got {type(cache_salt).__name__}")
        self.request_id = request_id
        self.max_length = max_length
        self.cache_salt = cache_salt
        self.cached_prefix_length: int | None = None
        """Prompt tokens served from the prefix cache at first admission (set by the manager)."""
        self._buf = np.empty(max(16, 2 * prompt.size), dtype=np.int64)
        self._buf[: prompt.size] = prompt
        self._readonly = _readonly_view(self._buf)
        self.current_length: int = prompt.size
        """Number of tokens so far (read-only: `update` and `skip_processing` move it).
        A plain attribute, not a property: the manager reads it for every request
        of every step."""
        self.processed_length: int = 0
        """Tokens whose keys and values are already in the cache (read-only, as above)."""

    def __repr__(self) -> str:
        return (
            f"TextContext(request_id={self.request_id!r}, current_length={self.current_length}, "
            f"processed_length={self.processed_length})"
        )

    @property
    def tokens(self) -> npt.NDArray[np.int64]:
        """All tokens so far (a read-only view)."""
        return self._readonly[: self.current_length]

    @property
    def start_idx(self) -> int:
        """MAX's older name for `processed_length`."""
        return self.processed_length

    @property
    def active_length(self) -> int:
        """Tokens the next model step runs (and writes KV for)."""
        return self.current_length - self.processed_length

    @property
    def next_tokens(self) -> npt.NDArray[np.int64]:
        """The tokens the next model step runs: `tokens[processed_length:]`."""
        return self.tokens[self.processed_length :]

    def update(self, token: int) -> None:
        """Appends a generated token; the tokens just run now count as cached."""
        if self.max_length is not None and self.current_length >= self.max_length:
            raise ValueError(f"request {self.request_id!r} is already at max_length={self.max_length}")
        if self.current_length == self._buf.size:
            grown = np.empty(2 * self._buf.size, dtype=np.int64)
            grown[: self.current_length] = self._buf[: self.current_length]
            self._buf = grown
            self._readonly = _readonly_view(grown)
        self._buf[self.current_length] = token
        self.processed_length = self.current_length
        self.current_length += 1

    def skip_processing(self, n: int) -> None:
        """Marks the next `n` active tokens as cached (a prefix-cache hit).

        At least one token must stay active: the model has to run the last
        token to produce the next one.
        """
        if n < 0 or n >= self.active_length:
            raise ValueError(
                f"cannot skip {n} tokens of request {self.request_id!r}: "
                f"{self.active_length} are active and at least 1 must stay active"
            )
        self.processed_length += n


def _readonly_view(buffer: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
    """A read-only view of `buffer`: its slices are read-only too, which costs
    far less than marking each slice read-only as it is handed out."""
    view = buffer.view()
    view.flags.writeable = False
    return view


class MaxTextContextAdapter:
    """MAX's own `TextContext` seen as a `CacheContext`.

    MAX keeps token state on `ctx.tokens` (a `TokenBuffer`); its window may be
    chunked, so `current_length` is the window's end (`processed + active`),
    which can be shorter than `len(ctx.tokens)`.
    """

    __slots__ = ("context",)

    def __init__(self, context: Any) -> None:
        self.context = context

    @property
    def request_id(self) -> Hashable:
        return self.context.request_id

    @property
    def tokens(self) -> npt.NDArray[np.int64]:
        return self.context.tokens.all

    @property
    def processed_length(self) -> int:
        return self.context.tokens.processed_length

    @property
    def active_length(self) -> int:
        return self.context.tokens.active_length

    @property
    def current_length(self) -> int:
        return self.context.tokens.current_position

    @property
    def cache_salt(self) -> str | None:
        return getattr(self.context, "cache_salt", None)

    @property
    def cached_prefix_length(self) -> int | None:
        return self.context.cached_prefix_length

    @cached_prefix_length.setter
    def cached_prefix_length(self, value: int | None) -> None:
        # MAX sets both on first admission; mokv counts its tiers' hits in the first, none as external.
        self.context.cached_prefix_length = value
        self.context.cached_prefix_external_length = 0

    def skip_processing(self, n: int) -> None:
        self.context.tokens.skip_processing(n)


def _as_is(context: Any) -> CacheContext:
    return context


_ADAPTERS: dict[type, Callable[[Any], CacheContext]] = {TextContext: _as_is, MaxTextContextAdapter: _as_is}
"""How each context type becomes a `CacheContext`; adapting twice is harmless."""


def _max_context_type() -> type | None:
    """MAX's `TextContext` class, if `max.pipelines` (the `max[serve]` extra) is installed."""
    try:
        from max.pipelines.context import TextContext as MaxTextContext
    except ImportError:
        return None
    return MaxTextContext


def cache_context(context: object) -> CacheContext:
    """`context` as a `CacheContext`: mokv's `TextContext` as it is, MAX's
    `TextContext` (or a subclass) through `MaxTextContextAdapter`.

    Raises:
        TypeError: `context` is of no supported type.
    """
    adapt = _ADAPTERS.get(type(context))
    if adapt is None:
        max_type = _max_context_type()
        if max_type is not None and isinstance(context, max_type):
            adapt = _ADAPTERS[type(context)] = MaxTextContextAdapter
        elif isinstance(context, TextContext):
            adapt = _ADAPTERS[type(context)] = _as_is
        else:
            raise TypeError(
                f"expected a mokv.TextContext or MAX's max.pipelines.context.TextContext, "
                f"got {type(context).__module__}.{type(context).__qualname__}"
            )
    return adapt(context)


def check_same_tokens(known: CacheContext | None, ctx: CacheContext) -> None:
    """Refuses `ctx`, a second context object under a live request id, when its
    tokens differ from `known` (the request's context so far) wherever both
    have tokens: a copy of the request, or the request seen later, passes.

    Raises:
        ValueError: The first position where they differ, and both tokens.
    """
    if known is None:
        return
    mine, theirs = known.tokens, ctx.tokens
    n = min(len(mine), len(theirs))
    differ = np.flatnonzero(mine[:n] != theirs[:n])
    if len(differ):
        i = int(differ[0])
        raise ValueError(
            f"request {ctx.request_id!r} is live with other tokens: this context has token "
            f"{int(theirs[i])} at position {i}, the request's has {int(mine[i])}"
        )
