"""The README's "Using it in a graph" example runs as written and computes
causal attention (checked against numpy)."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np

README = Path(__file__).resolve().parents[1] / "README.md"


def readme_example() -> str:
    section = README.read_text().split("## Using it in a graph", 1)[1]
    match = re.search(r"```python\n(.*?)```", section, re.DOTALL)
    assert match, "the section has no python example"
    return match.group(1)


def test_using_it_in_a_graph_runs_as_written() -> None:
    namespace: dict = {}
    exec(compile(readme_example(), str(README), "exec"), namespace)
    q, k, v = namespace["q"], namespace["k"], namespace["v"]
    keys, values = np.repeat(k, 2, axis=1), np.repeat(v, 2, axis=1)  # query head h reads KV head h // 2
    scores = np.einsum("qhd,khd->hqk", q, keys) / 4.0
    scores[:, np.triu(np.ones((20, 20), bool), 1)] = -np.inf
    probs = np.exp(scores - scores.max(axis=-1, keepdims=True))
    probs /= probs.sum(axis=-1, keepdims=True)
    expected = np.einsum("hqk,khd->qhd", probs, values)
    np.testing.assert_allclose(namespace["out"].to_numpy(), expected, rtol=1e-4, atol=1e-5)
    assert namespace["manager"].num_free_blocks() == 64
