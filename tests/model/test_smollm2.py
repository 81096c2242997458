"""SmolLM2-135M-Instruct end to end: files, tokenizer, and the dense MAX graph against the
independent numpy forward (reference/numpy_llama.py)."""

from __future__ import annotations

import numpy as np
import pytest
from max.engine import Model

from mokv_models import model_files
from mokv_models.gguf_model import LlamaCheckpoint, load_llama, unpermute_rope_rows
from mokv_models.llama import ragged_batch
from mokv_models.tokenizer import GGUFTokenizer
from mokv_reference.numpy_llama import llama_cpp_permute, numpy_llama_logits

# float32 graph vs float64 reference through 30 layers: measured max |diff| 2e-6..7e-6 of the
# largest |logit| (~25). 1e-4 leaves >10x margin and still catches real mistakes: a mask that
# leaked across tokens (seen in a 1-layer graph) moved logits by 1e-3..1e-2 of the largest.
LOGIT_RTOL_OF_MAX = 1e-4

FRANCE = [{"role": "user", "content": "What is the capital of France?"}]


def _logits(model: Model, chunks: list[np.ndarray], context_length: int) -> np.ndarray:
    batch = ragged_batch(chunks, context_length=context_length)
    return model.execute(*batch.inputs())[0].to_numpy()


def _greedy_dense(
    model: Model, prompts: list[np.ndarray], stop_ids: frozenset[int], max_new_tokens: int, context_length: int
) -> list[list[int]]:
    """Greedy decoding by full recomputation: every step reruns each unfinished sequence from its
    first token as one ragged batch (what a KV cache must reproduce)."""
    sequences = [np.asarray(p, np.int64) for p in prompts]
    generated: list[list[int]] = [[] for _ in prompts]
    active = list(range(len(prompts)))
    for _ in range(max_new_tokens):
        next_ids = _logits(model, [sequences[i] for i in active], context_length).argmax(axis=1)
        still_active = []
        for i, token in zip(active, next_ids.tolist(), strict=True):
            if token in stop_ids:
                continue
            sequences[i] = np.append(sequences[i], token)
            generated[i].append(token)
            still_active.append(i)
        active = still_active
        if not active:
            break
    return generated


def test_missing_wheel_error_names_fetch_command(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv(model_files.CACHE_ENV, str(tmp_path))
    with pytest.raises(FileNotFoundError, match=r"mokv_models\.model_files fetch"):
        model_files.smollm2_gguf_path()


def test_a_new_weight_cache_version_replaces_the_older_ones(tmp_path, monkeypatch, checkpoints) -> None:
    gguf_path = model_files.smollm2_gguf_path()
    name = "blk.0.ffn_down.weight"
    expected = np.array(checkpoints("gguf").weights[name])  # the session's cache, before moving it
    monkeypatch.setenv(model_files.CACHE_ENV, str(tmp_path))
    older = model_files.derived_cache_path(gguf_path, "gguf-v1")
    other_format = model_files.derived_cache_path(gguf_path, "f32-v1")
    for stale in (older, other_format):
        stale.mkdir(parents=True)
        (stale / "config.json").write_text("{}")
    converted = load_llama(gguf_path, weights="gguf")
    assert not older.exists()
    assert other_format.exists()
    np.testing.assert_array_equal(converted.weights[name], expected)


def test_config_is_smollm2_135m(smollm2: LlamaCheckpoint) -> None:
    c = smollm2.config
    assert (c.n_layers, c.hidden_size, c.n_heads, c.n_kv_heads, c.head_dim) == (30, 576, 9, 3, 64)
    assert (c.ffn_hidden_size, c.vocab_size, c.rope_base) == (1536, 49152, 100000.0)
    assert c.rms_norm_eps == pytest.approx(1e-5) and c.tied_embeddings
    assert smollm2.weights["token_embd.weight"].shape == (49152, 576)
    assert smollm2.weights["blk.29.attn_k.weight"].shape == (192, 576)
    assert all(w.dtype == np.float32 for w in smollm2.weights.values())


def test_unpermute_inverts_the_converter_permutation() -> None:
    w = np.random.default_rng(0).standard_normal((3 * 64, 5))
    np.testing.assert_array_equal(unpermute_rope_rows(llama_cpp_permute(w, 3), 3), w)


@pytest.mark.parametrize(
    "text",
    [
        "Hello world",
        "  leading spaces\tand\ttabs\n\nnewlines ",
        "Prices: 12,345.67 €, 2024-01-31",
        "naïve café — 日本語のテキスト 😀🚀",
        "<|im_start|>user\nhi<|im_end|>\n",
        "def f(x):\n    return x**2",
    ],
)
def test_tokenizer_round_trips(smollm2_tokenizer: GGUFTokenizer, text: str) -> None:
    ids = smollm2_tokenizer.encode(text)
    assert ids.dtype == np.int64
    assert smollm2_tokenizer.decode(ids) == text


def test_tokenizer_merges_splits_digits_and_keeps_control_tokens(smollm2_tokenizer: GGUFTokenizer) -> None:
    tok = smollm2_tokenizer
    assert [tok.decode([i]) for i in tok.encode("Hello world")] == ["Hello", " world"]  # BPE merges applied
    assert [tok.decode([i]) for i in tok.encode("in 2024")] == ["in", " ", "2", "0", "2", "4"]
    assert tok.encode("<|im_start|>").tolist() == [1] and tok.encode("<|im_end|>").tolist() == [2]
    assert tok.eos_token_id == 2 and tok.stop_token_ids == {2}
    assert tok.vocab_size == 49152


def test_chat_template_inserts_default_system_prompt(smollm2_tokenizer: GGUFTokenizer) -> None:
    tok = smollm2_tokenizer
    assert tok.apply_chat_template(FRANCE) == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    )
    with_system = [{"role": "system", "content": "Be brief."}, *FRANCE]
    assert tok.apply_chat_template(with_system, add_generation_prompt=False) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
    )
    ids = tok.encode_chat(FRANCE)
    assert ids[0] == 1 and tok.decode(ids) == tok.apply_chat_template(FRANCE)  # no BOS added


def test_ragged_batch_positions_and_offsets() -> None:
    batch = ragged_batch([np.array([5, 6, 7]), np.array([8]), np.array([9, 10])], [0, 4, 2], context_length=16)
    assert batch.tokens.tolist() == [5, 6, 7, 8, 9, 10]
    assert batch.input_row_offsets.dtype == np.uint32 and batch.input_row_offsets.tolist() == [0, 3, 4, 6]
    assert batch.positions.tolist() == [0, 1, 2, 4, 2, 3]
    with pytest.raises(ValueError, match="exceed context_length"):
        ragged_batch([np.array([1, 2])], [15], context_length=16)
    with pytest.raises(ValueError, match="at least one token"):
        ragged_batch([np.array([1]), np.array([], np.int64)], context_length=16)


def test_dense_graph_matches_numpy_reference(
    dense_smollm2: Model, smollm2: LlamaCheckpoint, smollm2_tokenizer: GGUFTokenizer
) -> None:
    """Last-token logits of a 3-sequence ragged batch (37, 4 and 1 tokens) against the float64
    numpy forward of each sequence alone."""
    chunks = [
        smollm2_tokenizer.encode_chat(FRANCE),
        smollm2_tokenizer.encode("The quick brown fox"),
        np.array([1], np.int64),
    ]
    logits = _logits(dense_smollm2, chunks, smollm2.config.context_length)
    assert logits.shape == (3, smollm2.config.vocab_size) and logits.dtype == np.float32
    for row, chunk in zip(logits, chunks, strict=True):
        expected = numpy_llama_logits(smollm2, chunk)[-1]
        np.testing.assert_allclose(row, expected, rtol=0, atol=LOGIT_RTOL_OF_MAX * np.abs(expected).max())
        assert row.argmax() == expected.argmax()


def test_ragged_batch_sequences_do_not_see_each_other(dense_smollm2: Model, smollm2: LlamaCheckpoint) -> None:
    """A sequence's logits are the same alone and between two other sequences."""
    rng = np.random.default_rng(1)
    a, b, c = (rng.integers(0, smollm2.config.vocab_size, n) for n in (7, 12, 3))
    ctx = smollm2.config.context_length
    together = _logits(dense_smollm2, [a, b, c], ctx)
    alone = np.concatenate([_logits(dense_smollm2, [x], ctx) for x in (a, b, c)])
    np.testing.assert_allclose(together, alone, rtol=0, atol=LOGIT_RTOL_OF_MAX * np.abs(alone).max())


def test_greedy_generation_answers_in_english(
    dense_smollm2: Model, smollm2: LlamaCheckpoint, smollm2_tokenizer: GGUFTokenizer
) -> None:
    tok = smollm2_tokenizer
    prompts = [tok.encode_chat(FRANCE), tok.encode_chat([{"role": "user", "content": "What is 2 + 2?"}])]
    france, arithmetic = (
        tok.decode(ids)
        for ids in _greedy_dense(dense_smollm2, prompts, tok.stop_token_ids, 24, smollm2.config.context_length)
    )
    assert "Paris" in france
    assert "4" in arithmetic
