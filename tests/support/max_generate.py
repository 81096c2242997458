"""Driving MAX's own text-generation pipeline (`max.pipelines.lib.generate`, the batch API
under `max generate`) in tests: a `PipelineConfig` for SmolLM2's model directory
(`mokv_examples.max_model.ensure_model_dir`), two batches of chat prompts, and a pipeline's
greedy run built through a registry of its own (so MAX's global architecture table keeps
MAX's Llama). Test modules import it, never a conftest: importing MAX's pipelines changes
the process's C-level environment, and xdist's workers started after that lose the venv."""

from __future__ import annotations

import gc
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from max.driver import DeviceSpec
from max.nn.kv_cache.metrics import KVCacheMetrics
from max.pipelines.lib import PipelineArgs, PipelineConfig
from max.pipelines.lib.arch_lookup import ArchLookup
from max.pipelines.lib.generate import generate
from max.pipelines.lib.registry import PipelineRegistry

from mokv_examples.max_model import weights_file
from mokv_models.tokenizer import load_tokenizer
from tests.support.pipelines import SERVE_MAX_BATCH, SERVE_MAX_LENGTH

NEW_TOKENS = 24
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


def pipeline_config(model_dir: Path, encoding: str, device: DeviceSpec, **flags: str) -> PipelineConfig:
    """The pipeline over `model_dir`'s `encoding` weights on `device`, with the server's
    batch and context (one compiled graph serves `max generate`'s test and `max serve`)."""
    args = PipelineArgs.from_flat_kwargs(
        model_path=str(model_dir),
        weight_path=[str(model_dir / weights_file(encoding))],
        quantization_encoding=encoding,
        device_specs=[device],
        max_batch_size=SERVE_MAX_BATCH,
        max_length=SERVE_MAX_LENGTH,
        **flags,
    )
    return PipelineConfig.from_args(args)


def chat_batches() -> list[list[list[int]]]:
    """Two batches of chat prompts (token ids); the second repeats the first's long prompt."""
    tokenizer = load_tokenizer()
    prompts = [tokenizer.encode_chat([{"role": "user", "content": q}]).tolist() for q in QUESTIONS]
    assert len(prompts[2]) > 128, "the repeated prompt must fill a page to be served from the prefix cache"
    return [prompts, [prompts[2], prompts[0]]]


@dataclass
class GreedyRun:
    """One pipeline's greedy tokens per batch, the first batch's logits after
    its prompts (`[rows, vocab]`), and its KV manager after them."""

    tokens: list[list[list[int]]]
    first_logits: np.ndarray
    manager: type
    metrics: KVCacheMetrics


def greedy_run(arch: object, config: PipelineConfig, batches: list[list[list[int]]]) -> GreedyRun:
    """Each batch's `NEW_TOKENS` greedy tokens through a pipeline of `arch`, built in a
    registry of its own and released before returning."""
    _, pipeline = PipelineRegistry([arch], arch_lookup=ArchLookup()).retrieve(config)
    tokens, logits = [], []
    for batch in batches:
        result = generate(pipeline, batch, max_new_tokens=NEW_TOKENS, top_k=1, ignore_eos=True, output_logits=True)
        tokens.append([row[len(prompt) :] for row, prompt in zip(result.sequences, batch, strict=True)])
        logits.append(np.stack([np.asarray(row_logits)[0] for row_logits in result.logits]))
    manager = pipeline._kv_manager
    run = GreedyRun(tokens, logits[0], type(manager), manager.get_metrics_aggregated())
    del pipeline, manager
    gc.collect()
    return run
