"""A request's tokens and how many of them already have KV in the cache.

`TextContext` is the small subset of MAX's `TextContext` that a KV cache
manager and a simple generation loop need:

    tokens:   [ processed (KV cached) | active (run this step) ]
              0          processed_length                current_length

Tokens live in one growable int64 array so appending a generated token is O(1)
amortised and `tokens` is a view, never a copy.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt


class TextContext:
    """Token bookkeeping for one request.

    Args:
        request_id: Unique id the cache manager files the request under.
        tokens: The prompt, a 1-D integer array (copied).
        max_length: Most tokens the request may ever hold, or None for no limit.
    """

    __slots__ = ("_buf", "_length", "_processed", "max_length", "request_id")

    def __init__(
        self,
        request_id: str,
        tokens: npt.ArrayLike,
        max_length: int | None = None,
    ) -> None:
        prompt = np.asarray(tokens)
        if prompt.ndim != 1 or prompt.size == 0:
            raise ValueError(f"tokens must be a non-empty 1-D array, got shape {prompt.shape}")
        if not np.issubdtype(prompt.dtype, np.integer):
            raise TypeError(f"tokens must be integers, got dtype {prompt.dtype}")
        if max_length is not None and prompt.size > max_length:
            raise ValueError(f"prompt of {prompt.size} tokens exceeds max_length={max_length}")
        self.request_id = request_id
        self.max_length = max_length
        self._buf = np.empty(max(16, 2 * prompt.size), dtype=np.int64)
        self._buf[: prompt.size] = prompt
        self._length = prompt.size
        self._processed = 0

    def __repr__(self) -> str:
        return (
            f"TextContext(request_id={self.request_id!r}, current_length={self._length}, "
            f"processed_length={self._processed})"
        )

    @property
    def tokens(self) -> npt.NDArray[np.int64]:
        """All tokens so far (a read-only view)."""
        view = self._buf[: self._length]
        view.flags.writeable = False
        return view

    @property
    def current_length(self) -> int:
        """Number of tokens so far."""
        return self._length

    @property
    def processed_length(self) -> int:
        """Tokens whose keys and values are already in the cache."""
        return self._processed

    @property
    def start_idx(self) -> int:
        """MAX's older name for `processed_length`."""
        return self._processed

    @property
    def active_length(self) -> int:
        """Tokens the next model step runs (and writes KV for)."""
        return self._length - self._processed

    @property
    def next_tokens(self) -> npt.NDArray[np.int64]:
        """The tokens the next model step runs: `tokens[processed_length:]`."""
        return self.tokens[self._processed :]

    def update(self, token: int) -> None:
        """Appends a generated token; the tokens just run now count as cached."""
        if self.max_length is not None and self._length >= self.max_length:
            raise ValueError(
                f"request {self.request_id!r} is already at max_length={self.max_length}"
            )
        if self._length == self._buf.size:
            grown = np.empty(2 * self._buf.size, dtype=np.int64)
            grown[: self._length] = self._buf[: self._length]
            self._buf = grown
        self._buf[self._length] = token
        self._processed = self._length
        self._length += 1

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
        self._processed += n
