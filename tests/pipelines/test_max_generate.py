"""`max generate`'s pipeline (MAX's `TextGenerationPipeline`, driven by
`max.pipelines.lib.generate`, the batch API under `max generate`) on SmolLM2,
with MAX's own Llama and with mokv's architecture module, on CPU: the greedy
tokens must be equal.

Both pipelines are built from one `PipelineConfig` (the `mokv max-model`
directory, float32 weights, MAX's default cache flags: 128-token pages,
prefix caching on) through registries of their own, so MAX's global
architecture table keeps MAX's Llama for the rest of the session; that
`--custom-architectures mokv.pipelines.architecture` registers mokv's
architecture is checked apart. Each pipeline compiles once per session.

The second batch repeats the long prompt of the first: both managers serve
its first page from their prefix caches, and the tokens must still agree.
Greedy tokens could differ only where two logits tie within the attention
kernels' rounding (~1e-6 here); these prompts have no such tie.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("max.pipelines.context")

from max.driver import DeviceSpec
from max.pipelines.architectures.llama3 import llama_arch
from max.pipelines.lib import PipelineConfig
from max.pipelines.lib.arch_lookup import ArchLookup

from mokv.pipelines import architecture
from mokv.pipelines.attention import CacheStep, MokvAttentionWithRope
from mokv.pipelines.scheduler_manager import SchedulerKVCacheManager
from tests.support.max_generate import NEW_TOKENS, GreedyRun, chat_batches, greedy_run, pipeline_config
from tests.support.pipelines import MAX_MODEL_ENCODING

pytestmark = pytest.mark.slow

FLOAT8_LOGIT_ATOL = 2.5
"""How far a float8 cache moves the logits after the prompts: e4m3 keeps 3
mantissa bits (up to 6% per element, each token and head scaled to its own
absolute maximum); measured up to 1.4 on logits up to ~30."""


def _config(model_dir: Path, **flags: str) -> PipelineConfig:
    return pipeline_config(model_dir, MAX_MODEL_ENCODING, DeviceSpec.cpu(), **flags)


@dataclass
class Built:
    """What mokv's architecture did while its pipeline built the decoder graph."""

    converted: list[object] = field(default_factory=list)
    prepared: int = 0


@pytest.fixture(scope="module")
def runs(max_model_dir) -> tuple[GreedyRun, GreedyRun, Built]:
    """MAX's Llama's run, mokv's run, and what building mokv's graph did (the
    attention layers turned into twins, the cache steps prepared)."""
    config = _config(max_model_dir)
    built = Built()
    to_mokv, prepare = architecture.to_mokv, CacheStep.prepare

    def converting(layer):
        built.converted.append(to_mokv(layer))
        return layer

    def preparing(cls, *args):
        built.prepared += 1
        return prepare(*args)

    theirs = greedy_run(llama_arch, config, chat_batches())
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(architecture, "to_mokv", converting)
        patch.setattr(CacheStep, "prepare", classmethod(preparing))
        ours = greedy_run(architecture.mokv_llama_arch, config, chat_batches())
    return theirs, ours, built


def test_mokv_pipeline_generates_maxs_greedy_tokens(runs) -> None:
    theirs, ours, built = runs
    assert ours.manager is SchedulerKVCacheManager and theirs.manager is not SchedulerKVCacheManager
    assert len(built.converted) == 30 and all(type(layer) is MokvAttentionWithRope for layer in built.converted)
    assert built.prepared == 1  # one cache mapping and rotary gather per forward, shared by the 30 layers
    assert all(len(row) == NEW_TOKENS for batch in ours.tokens for row in batch)
    assert ours.tokens == theirs.tokens
    # the repeated prompt's first page came from the prefix cache, in both managers
    assert ours.metrics.cache_tokens >= 128 and theirs.metrics.cache_tokens >= 128


def test_float8_cache_in_maxs_scale_layout_predicts_as_float32_within_its_rounding(runs, max_model_dir) -> None:
    """`--kv-cache-format float8_e4m3fn` through mokv's architecture: MAX's
    scale layout (one float32 scale per token and KV head) and uint8 graph
    blocks, written and read by mokv's ops. The next-token logits after the
    prompts stay within `FLOAT8_LOGIT_ATOL` of MAX's float32 run, a bound a
    cache read at the wrong pages or scales would break by the logits' own
    magnitude (~20-30)."""
    theirs, _, _ = runs
    config = _config(max_model_dir, kv_cache_format="float8_e4m3fn")
    float8 = greedy_run(architecture.mokv_llama_arch, config, chat_batches()[:1])
    assert float8.manager is SchedulerKVCacheManager
    np.testing.assert_allclose(float8.first_logits, theirs.first_logits, atol=FLOAT8_LOGIT_ATOL, rtol=0)
    assert np.abs(theirs.first_logits).max() > 10 * FLOAT8_LOGIT_ATOL


def test_custom_architectures_flag_registers_mokvs_llama() -> None:
    """What `--custom-architectures mokv.pipelines.architecture` does: MAX
    imports the module and its `ARCHITECTURES` replace MAX's Llama."""
    lookup = ArchLookup()
    lookup.register(llama_arch)
    lookup.import_custom_architectures(["mokv.pipelines.architecture"])
    arch = lookup.resolve("LlamaForCausalLM")
    assert arch is architecture.mokv_llama_arch
    assert arch.pipeline_cls is architecture.MokvTextGenerationPipeline
    assert arch.pipeline_model is architecture.MokvLlama3Model
