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

import gc
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("max.pipelines.context")

from max.driver import DeviceSpec
from max.nn.kv_cache.metrics import KVCacheMetrics
from max.pipelines.architectures.llama3 import llama_arch
from max.pipelines.lib import PipelineArgs, PipelineConfig
from max.pipelines.lib.arch_lookup import ArchLookup
from max.pipelines.lib.generate import generate
from max.pipelines.lib.registry import PipelineRegistry

from mokv.pipelines import architecture
from mokv.pipelines.attention import CacheStep, MokvAttentionWithRope
from mokv.pipelines.scheduler_manager import SchedulerKVCacheManager
from mokv_examples.max_model import weights_file
from mokv_models.tokenizer import load_tokenizer
from tests.support.pipelines import MAX_MODEL_ENCODING, SERVE_MAX_BATCH, SERVE_MAX_LENGTH

pytestmark = pytest.mark.slow

NEW_TOKENS = 24
FLOAT8_LOGIT_ATOL = 2.5
"""How far a float8 cache moves the logits after the prompts: e4m3 keeps 3
mantissa bits (up to 6% per element, each token and head scaled to its own
absolute maximum); measured up to 1.4 on logits up to ~30."""
QUESTIONS = [
    "What is the capital of France?",
    "List three prime numbers.",
    "Explain, for a reader who has never heard of caches, why a web browser keeps copies of the pages, "
    "images and scripts it has already downloaded, what can go wrong when a copy is stale, and how "
    "a server tells the browser how long a copy may be kept. Then explain why a language model that "
    "answers a long conversation keeps the keys and values of every earlier token instead of "
    "recomputing them, how much memory that takes for a model with thirty layers, and what a server "
    "can do when many users send the same long instructions at the start of their chats. Give one "
    "example from everyday browsing and one from a chat assistant, each in two sentences.",
]


def _config(model_dir: Path, **flags: str) -> PipelineConfig:
    args = PipelineArgs.from_flat_kwargs(
        model_path=str(model_dir),
        weight_path=[str(model_dir / weights_file(MAX_MODEL_ENCODING))],
        quantization_encoding=MAX_MODEL_ENCODING,
        device_specs=[DeviceSpec.cpu()],
        max_batch_size=SERVE_MAX_BATCH,  # the server's batch and context: one compiled graph serves both
        max_length=SERVE_MAX_LENGTH,
        **flags,
    )
    return PipelineConfig.from_args(args)


def _batches() -> list[list[list[int]]]:
    """Two batches of chat prompts (token ids); the second repeats the first's long prompt."""
    tokenizer = load_tokenizer()
    prompts = [tokenizer.encode_chat([{"role": "user", "content": q}]).tolist() for q in QUESTIONS]
    assert len(prompts[2]) > 128, "the repeated prompt must fill a page to be served from the prefix cache"
    return [prompts, [prompts[2], prompts[0]]]


@dataclass
class Run:
    """One pipeline's greedy tokens per batch, the first batch's logits after
    its prompts (`[rows, vocab]`), and its KV manager after them."""

    tokens: list[list[list[int]]]
    first_logits: np.ndarray
    manager: type
    metrics: KVCacheMetrics


def _greedy(arch, config: PipelineConfig, batches: list[list[list[int]]]) -> Run:
    """Each batch's new tokens through a pipeline of `arch`, built in a registry of its own."""
    _, pipeline = PipelineRegistry([arch], arch_lookup=ArchLookup()).retrieve(config)
    tokens, logits = [], []
    for batch in batches:
        result = generate(pipeline, batch, max_new_tokens=NEW_TOKENS, top_k=1, ignore_eos=True, output_logits=True)
        tokens.append([row[len(prompt) :] for row, prompt in zip(result.sequences, batch, strict=True)])
        logits.append(np.stack([np.asarray(row_logits)[0] for row_logits in result.logits]))
    manager = pipeline._kv_manager
    run = Run(tokens, logits[0], type(manager), manager.get_metrics_aggregated())
    del pipeline, manager
    gc.collect()
    return run


@dataclass
class Built:
    """What mokv's architecture did while its pipeline built the decoder graph."""

    converted: list[object] = field(default_factory=list)
    prepared: int = 0


@pytest.fixture(scope="module")
def runs(max_model_dir) -> tuple[Run, Run, Built]:
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

    theirs = _greedy(llama_arch, config, _batches())
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(architecture, "to_mokv", converting)
        patch.setattr(CacheStep, "prepare", classmethod(preparing))
        ours = _greedy(architecture.mokv_llama_arch, config, _batches())
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
    float8 = _greedy(architecture.mokv_llama_arch, config, _batches()[:1])
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
