"""Log-probabilities of chosen tokens and their top alternatives, from logits.

Shared by `mokv score` (teacher-forced: the chosen token is the text's next token) and
`mokv generate --logprobs N` (the chosen token is the sampled one). Computed in float64 from
the graph's float32 logits, so the reported numbers carry no extra rounding of their own.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt


@dataclass(frozen=True)
class TokenLogprob:
    """The log-probability of one chosen token, and the `top` most likely tokens at that
    position as `(token_id, logprob)`, most likely first."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]

    def as_json(self) -> dict:
        return {"token_id": self.token_id, "logprob": self.logprob, "top": [list(t) for t in self.top]}


def log_softmax(logits: npt.NDArray[np.floating]) -> npt.NDArray[np.float64]:
    """Row-wise `log(softmax(logits))`, in float64."""
    z = np.asarray(logits, np.float64)
    z = z - z.max(axis=-1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


def token_logprobs(logits: npt.NDArray[np.floating], chosen: npt.NDArray[np.integer], top_k: int) -> list[TokenLogprob]:
    """One `TokenLogprob` per row of `logits` `[rows, vocab]`, for token `chosen[row]`."""
    if top_k < 1:
        raise ValueError(f"top_k must be >= 1, got {top_k}")
    chosen = np.asarray(chosen, np.int64)
    if logits.ndim != 2 or chosen.shape != (len(logits),):
        raise ValueError(
            f"expected logits [rows, vocab] and one chosen token per row, got {logits.shape}, {chosen.shape}"
        )
    lp = log_softmax(logits)
    k = min(top_k, lp.shape[1])
    top = np.argpartition(-lp, k - 1, axis=1)[:, :k]
    top_lp = np.take_along_axis(lp, top, axis=1)
    order = np.argsort(-top_lp, axis=1, kind="stable")
    top, top_lp = np.take_along_axis(top, order, axis=1), np.take_along_axis(top_lp, order, axis=1)
    picked = lp[np.arange(len(lp)), chosen]
    return [
        TokenLogprob(int(c), float(p), list(zip(ids.tolist(), vals.tolist(), strict=True)))
        for c, p, ids, vals in zip(chosen, picked, top, top_lp, strict=True)
    ]
