"""TextContext: the processed/active bookkeeping, side by side with MAX's own TextContext."""

from __future__ import annotations

import numpy as np
import pytest

from mokv import TextContext


def test_update_and_skip_match_max() -> None:
    max_context = pytest.importorskip("max.pipelines.context")
    prompt = np.arange(7, dtype=np.int64)
    ours = TextContext("r", prompt)
    theirs = max_context.TextContext(max_length=100, tokens=max_context.TokenBuffer(prompt.copy()))

    def same() -> None:
        assert ours.processed_length == theirs.tokens.processed_length
        assert ours.active_length == theirs.tokens.active_length
        assert ours.current_length == len(theirs.tokens)
        np.testing.assert_array_equal(ours.tokens, theirs.tokens.all)
        np.testing.assert_array_equal(ours.next_tokens, theirs.tokens.active)

    same()
    ours.skip_processing(4)
    theirs.tokens.skip_processing(4)
    same()
    for token in range(40):  # past the initial capacity
        ours.update(token)
        theirs.update(token)
        same()
    assert ours.start_idx == ours.processed_length == 46


def test_prompt_is_copied_and_tokens_are_read_only() -> None:
    prompt = np.array([1, 2, 3], dtype=np.int32)
    c = TextContext("r", prompt)
    prompt[0] = 9
    assert c.tokens.tolist() == [1, 2, 3] and c.tokens.dtype == np.int64
    with pytest.raises(ValueError, match="read-only"):
        c.tokens[0] = 5
    for token in range(20):  # past the initial capacity: a new buffer, still read-only
        c.update(token)
    with pytest.raises(ValueError, match="read-only"):
        c.tokens[-1] = 5
    assert c.tokens.tolist() == [1, 2, 3, *range(20)]


def test_errors() -> None:
    c = TextContext("r", [1, 2, 3], max_length=4)
    with pytest.raises(ValueError, match="cannot skip 3 tokens of request 'r': 3 are active"):
        c.skip_processing(3)
    with pytest.raises(ValueError, match="cannot skip -1 tokens"):
        c.skip_processing(-1)
    c.update(4)
    with pytest.raises(ValueError, match="already at max_length=4"):
        c.update(5)
    with pytest.raises(ValueError, match="prompt of 3 tokens exceeds max_length=2"):
        TextContext("r", [1, 2, 3], max_length=2)
    with pytest.raises(ValueError, match=r"non-empty 1-D array, got shape \(0,\)"):
        TextContext("r", [])
    with pytest.raises(TypeError, match="tokens must be integers, got dtype float64"):
        TextContext("r", [1.5])
