"""The README's "Using it in a graph" example runs as written and computes
causal attention (checked against numpy)."""

from __future__ import annotations

import numpy as np

from mokv_reference.attention import causal_attention
from tests.support.readme import README, readme_example


def test_using_it_in_a_graph_runs_as_written() -> None:
    namespace: dict = {}
    exec(compile(readme_example(), str(README), "exec"), namespace)
    q, k, v = namespace["q"], namespace["k"], namespace["v"]
    expected = causal_attention(q, k, v, scale=1 / np.sqrt(q.shape[-1]))
    np.testing.assert_allclose(namespace["out"].to_numpy(), expected, rtol=1e-4, atol=1e-5)
    assert namespace["manager"].num_free_blocks() == 64
