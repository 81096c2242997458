"""SmolLM2-135M on a GPU: greedy tokens through mokv's paged cache (the real
scheduler: batched prefill, chunked prefill, decode, prefix caching) equal
to the dense no-cache graph's on the same GPU, both graphs compiled together."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
from max.driver import Device
from max.engine import InferenceSession
from max.graph import DeviceRef

from mokv.graph import GraphGroup
from mokv_examples.pipeline import CompiledGraphs, GenerationConfig, SmolLM2, generate
from mokv_models.gguf_model import load_llama
from mokv_models.llama import llama_weights_registry
from tests.support.gpu import needs_gpu
from tests.support.smollm2 import QUESTIONS, SYSTEM, dense_and_paged_graphs, dense_greedy_fn

pytestmark = needs_gpu("SmolLM2-135M greedy generation on mokv's paged cache against the dense graph")

NEW_TOKENS = 32


@dataclass(frozen=True)
class GpuGraphs:
    """SmolLM2's paged pipeline and its dense reference on the GPU, compiled together."""

    compiled: CompiledGraphs
    dense_name: str


@pytest.fixture(scope="module")
def gpu_graphs(gpu_session: InferenceSession, gpu_ref: DeviceRef) -> GpuGraphs:
    checkpoint = load_llama(weights="f32")  # block kernels: CPU only
    group = GraphGroup()
    dense_name = dense_and_paged_graphs(checkpoint, group, gpu_ref)
    models = group.load(gpu_session, weights_registry=llama_weights_registry(checkpoint))
    return GpuGraphs(CompiledGraphs(checkpoint, models), dense_name)


@pytest.fixture(scope="module")
def gpu_smollm2(gpu_session: InferenceSession, gpu: Device, gpu_graphs: GpuGraphs) -> SmolLM2:
    return SmolLM2(gpu_session, log=lambda _: None, weights="f32", device=gpu, compiled=gpu_graphs.compiled)


@pytest.fixture(scope="module")
def gpu_dense_greedy(gpu: Device, gpu_graphs: GpuGraphs, gpu_smollm2: SmolLM2):
    """Greedy tokens of the dense (no-cache) graph on the GPU, same weights."""
    dense = gpu_graphs.compiled.models[gpu_graphs.dense_name]
    return dense_greedy_fn(dense, gpu_smollm2.checkpoint, gpu_smollm2.tokenizer, gpu)


@pytest.fixture(scope="module")
def prompts(gpu_smollm2: SmolLM2) -> list[np.ndarray]:
    """The CPU generation tests' chat prompts: a shared system prompt, three questions."""
    return [
        gpu_smollm2.tokenizer.encode_chat([{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}])
        for q in QUESTIONS
    ]


@pytest.mark.parametrize("page_size", [16, 128])
@pytest.mark.parametrize("token_budget", [512, 24], ids=["whole-prefill", "chunked-prefill"])
def test_paged_greedy_matches_dense(page_size, token_budget, gpu_smollm2, gpu_dense_greedy, prompts):
    config = GenerationConfig(max_new_tokens=NEW_TOKENS, page_size=page_size, token_budget=token_budget)
    requests, _, _ = generate(gpu_smollm2, prompts, config)
    for prompt, request in zip(prompts, requests, strict=True):
        assert request.generated == gpu_dense_greedy(prompt, NEW_TOKENS)
