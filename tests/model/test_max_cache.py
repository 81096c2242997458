"""The same SmolLM2 graph on MAX 26.7's own paged cache (MAX's manager, KV store and flash
attention ops, `mokv_reference.max_cache`) against the dense graph: the same check mokv's
cache passes in test_paged_generation."""

from __future__ import annotations

import pytest

from mokv_examples.pipeline import GenerationConfig, generate
from tests.support.smollm2 import NEW_TOKENS


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_max_cache_greedy_matches_dense(max_cache_smollm2, prompts, dense_greedy, prefix_caching):
    config = GenerationConfig(max_new_tokens=NEW_TOKENS, page_size=16, enable_prefix_caching=prefix_caching)
    requests, _, _ = generate(max_cache_smollm2, prompts, config)
    assert [r.generated for r in requests] == [dense_greedy(p, NEW_TOKENS) for p in prompts]


def test_max_cache_refuses_another_page_size(max_cache_smollm2):
    with pytest.raises(ValueError, match="built for pages of 16 tokens, not 128"):
        max_cache_smollm2.new_manager(GenerationConfig(page_size=128))
