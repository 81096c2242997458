"""SmolLM2 on mokv's paged cache against a no-cache full recomputation of the same
graph (the dense backend, over the same weight format): greedy tokens must be
identical, batched or alone, at page sizes 16 and 128, with and without prefix
caching, through chunked prefill and preemption, for every weight format."""

from __future__ import annotations

import numpy as np
import pytest
from max.driver import Buffer

from mokv_examples.pipeline import GenerationConfig, SmolLM2, generate
from mokv_models.llama import ragged_batch
from mokv_models.weight_formats import WEIGHT_FORMATS
from tests.support.smollm2 import NEW_TOKENS, PAGED_LOGIT_ATOL, PAGED_LOGIT_RTOL, SYSTEM


@pytest.fixture(params=WEIGHT_FORMATS)
def weight_format(request) -> str:
    return request.param


@pytest.fixture
def paged_smollm2(paged_models, weight_format) -> SmolLM2:
    return paged_models(weight_format)


@pytest.fixture
def dense_smollm2(dense_models, weight_format):
    return dense_models(weight_format)


@pytest.fixture
def reference(greedy_references, weight_format):
    greedy = greedy_references(weight_format)
    return lambda prompt: greedy(prompt, NEW_TOKENS)


def _generate(model: SmolLM2, prompts, **config) -> list[list[int]]:
    requests, _, _ = generate(model, prompts, GenerationConfig(max_new_tokens=NEW_TOKENS, **config))
    return [r.generated for r in requests]


def test_paged_logits_match_dense(paged_smollm2, dense_smollm2, prompts, smollm2):
    """One prefill step of three prompts: same last-token logits as the dense graph (the
    two attention kernels sum in different orders; nothing else differs)."""
    from mokv import PagedKVCacheManager, TextContext

    manager = PagedKVCacheManager(paged_smollm2.cache_params(16, False), None, 64, max_batch_size=4)
    contexts = [TextContext(f"r{i}", p) for i, p in enumerate(prompts)]
    for ctx in contexts:
        manager.claim(ctx.request_id)
        manager.alloc(ctx)
    cache = manager.runtime_inputs_for_leaf([contexts])
    batch = ragged_batch(prompts, context_length=smollm2.config.context_length)
    paged = paged_smollm2.step(batch.tokens, batch.input_row_offsets, batch.positions, cache)
    (dense,) = dense_smollm2.execute(*(Buffer.from_numpy(a) for a in batch.inputs()))
    np.testing.assert_allclose(paged, dense.to_numpy(), atol=PAGED_LOGIT_ATOL, rtol=PAGED_LOGIT_RTOL)


@pytest.mark.parametrize("page_size", [16, 128])
@pytest.mark.parametrize("prefix_caching", [True, False])
def test_batched_greedy_matches_dense(paged_smollm2, prompts, reference, page_size, prefix_caching):
    got = _generate(paged_smollm2, prompts, page_size=page_size, enable_prefix_caching=prefix_caching)
    for prompt, tokens in zip(prompts, got, strict=True):
        assert len(tokens) >= min(NEW_TOKENS, len(reference(prompt)))
        assert tokens == reference(prompt)


def test_batch_one_matches_dense_and_batched(paged_smollm2, prompts, reference):
    alone = [_generate(paged_smollm2, [p], page_size=16)[0] for p in prompts]
    assert alone == [reference(p) for p in prompts]
    assert alone == _generate(paged_smollm2, prompts, page_size=16)


def test_prefix_hits_reuse_cached_pages_and_match_dense(paged_smollm2, prompts, reference):
    """The second and third prompts find the shared system prompt in the cache."""
    config = GenerationConfig(max_new_tokens=NEW_TOKENS, page_size=16, enable_prefix_caching=True)
    first, _, manager = generate(paged_smollm2, prompts[:1], config)
    rest, _, manager = generate(paged_smollm2, prompts[1:], config, manager=manager)
    metrics = manager.get_metrics_aggregated()
    shared = len(paged_smollm2.tokenizer.encode_chat([{"role": "system", "content": SYSTEM}]))
    assert metrics.cache_tokens >= 2 * (shared // 16) * 16 > 0
    assert [r.generated for r in first + rest] == [reference(p) for p in prompts]


def test_chunked_prefill_and_preemption_match_dense(paged_smollm2, prompts, reference):
    """A 24-token budget chunks every prefill; 9 pages of 16 cannot hold all three
    requests, so the youngest is preempted and recomputed."""
    requests, stats, _ = generate(
        paged_smollm2,
        prompts,
        GenerationConfig(
            max_new_tokens=NEW_TOKENS, page_size=16, num_pages=9, token_budget=24, enable_prefix_caching=False
        ),
    )
    assert stats.preemptions > 0
    assert [r.generated for r in requests] == [reference(p) for p in prompts]


def test_each_weight_format_keys_its_own_shared_kv(paged_models, tmp_path):
    """Shared KV tiers are keyed by the model id: KV computed under one weight
    format must never be served to another, so the formats' ids and the tiers'
    layout fingerprints differ."""
    config = GenerationConfig(disk_cache=str(tmp_path))
    models = [paged_models(fmt) for fmt in WEIGHT_FORMATS]
    assert len({m.model_id for m in models}) == len(WEIGHT_FORMATS)
    for model in models:
        with model.new_manager(config):
            pass
    layouts = [p for p in tmp_path.iterdir() if p.is_dir()]  # the disk tier's directory per layout fingerprint
    assert len(layouts) == len(WEIGHT_FORMATS)


def test_a_pipeline_takes_only_its_own_compiled_graph(session, smollm2_families):
    """A pipeline handed graphs compiled together picks its own by name (weights, cache,
    KV storage): one that is not among them is refused, never a neighbour taken for it."""
    compiled = smollm2_families("gguf").compiled
    pipeline = SmolLM2(session, log=lambda _: None, weights="gguf", compiled=compiled)
    assert pipeline.model is compiled.models["smollm2_gguf_on_mokv_float32_cpu"]
    with pytest.raises(KeyError, match="smollm2_gguf_on_mokv_int8_cpu"):
        SmolLM2(session, log=lambda _: None, weights="gguf", kv_dtype="int8", compiled=compiled)
    with pytest.raises(ValueError, match="weights 'f32': the compiled graphs run 'gguf'"):
        SmolLM2(session, log=lambda _: None, weights="f32", compiled=compiled)
