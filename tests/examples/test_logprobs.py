"""Log-probabilities and top-k from logits, against a direct float64 computation."""

from __future__ import annotations

import numpy as np
import pytest

from mokv_examples.logprobs import log_softmax, token_logprobs


def test_log_softmax_is_the_log_of_the_normalised_exponentials():
    logits = np.random.default_rng(0).standard_normal((4, 50)).astype(np.float32) * 30
    expected = np.log(np.exp(logits.astype(np.float64)) / np.exp(logits.astype(np.float64)).sum(-1, keepdims=True))
    np.testing.assert_allclose(log_softmax(logits), expected, rtol=1e-12, atol=1e-12)


def test_token_logprobs_pick_the_chosen_token_and_sort_the_top_k():
    logits = np.random.default_rng(1).standard_normal((3, 20)).astype(np.float32)
    chosen = np.array([4, 0, 19])
    scored = token_logprobs(logits, chosen, top_k=5)
    lp = log_softmax(logits)
    for row, s in enumerate(scored):
        assert s.token_id == chosen[row] and s.logprob == pytest.approx(lp[row, chosen[row]])
        expected_top = np.argsort(-lp[row])[:5]
        assert [t for t, _ in s.top] == expected_top.tolist()
        assert [v for _, v in s.top] == pytest.approx(lp[row, expected_top].tolist())


def test_token_logprobs_reject_bad_arguments():
    with pytest.raises(ValueError, match="top_k must be >= 1"):
        token_logprobs(np.zeros((1, 4)), np.array([0]), 0)
    with pytest.raises(ValueError, match="one chosen token per row"):
        token_logprobs(np.zeros((2, 4)), np.array([0]), 1)
