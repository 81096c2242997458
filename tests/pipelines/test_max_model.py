"""`mokv max-model`'s directory as MAX (through Hugging Face's loaders) reads
it: the config, the tokenizer and the weights agree with the source GGUF."""

from __future__ import annotations

import json

import gguf
import numpy as np
import pytest
from max.pipelines.lib.pipeline_variants.utils import get_rope_theta
from transformers import AutoConfig, AutoTokenizer

from mokv_examples.max_model import add_weights, default_model_dir, ensure_model_dir, weights_file
from mokv_models.gguf_model import load_llama
from mokv_models.model_files import smollm2_gguf_path
from mokv_models.tokenizer import load_tokenizer
from tests.support.pipelines import MAX_MODEL_ENCODING

MESSAGES = [
    {"role": "user", "content": "What is 12 + 30? Answer with digits: 42."},
    {"role": "assistant", "content": "42"},
    {"role": "user", "content": "Und auf Deutsch? <|im_end|> stays text"},
]


def test_config_is_the_ggufs_llama(max_model_dir) -> None:
    """As MAX reads it (`AutoConfig`, MAX's rope theta lookup)."""
    config = AutoConfig.from_pretrained(max_model_dir)
    ours = load_llama().config
    assert config.architectures == ["LlamaForCausalLM"] and config.tie_word_embeddings
    assert (config.num_hidden_layers, config.hidden_size, config.intermediate_size) == (
        ours.n_layers,
        ours.hidden_size,
        ours.ffn_hidden_size,
    )
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (
        ours.n_heads,
        ours.n_kv_heads,
        ours.head_dim,
    )
    assert (get_rope_theta(config), config.vocab_size) == (ours.rope_base, ours.vocab_size)
    assert config.rms_norm_eps == pytest.approx(ours.rms_norm_eps)


def test_tokenizer_encodes_and_renders_chats_as_the_gguf_does(max_model_dir) -> None:
    theirs, ours = AutoTokenizer.from_pretrained(max_model_dir), load_tokenizer()
    text = theirs.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert text == ours.apply_chat_template(MESSAGES)
    assert theirs.encode(text, add_special_tokens=False) == ours.encode(text).tolist()
    assert theirs.eos_token_id == ours.eos_token_id


def test_weights_are_the_ggufs_dequantized_in_llama_cpp_row_order(max_model_dir) -> None:
    written = {t.name: t for t in gguf.GGUFReader(max_model_dir / weights_file(MAX_MODEL_ENCODING)).tensors}
    source = {t.name: t for t in gguf.GGUFReader(smollm2_gguf_path()).tensors}
    assert written.keys() == source.keys() and "output.weight" not in written  # tied: the embedding is the head
    for name in ("token_embd.weight", "blk.0.attn_q.weight", "blk.29.ffn_down.weight", "output_norm.weight"):
        assert written[name].tensor_type == gguf.GGMLQuantizationType.F32
        expected = gguf.quants.dequantize(source[name].data, source[name].tensor_type)
        np.testing.assert_array_equal(np.asarray(written[name].data), expected, err_msg=name)
    generation = json.loads((max_model_dir / "generation_config.json").read_text())
    assert generation["eos_token_id"] == load_tokenizer().eos_token_id


def _bfloat16_bits(values: np.ndarray) -> np.ndarray:
    """float32 values rounded to bfloat16 (to nearest, ties to even), as uint16 bits."""
    bits = np.ascontiguousarray(values, np.float32).view(np.uint32).astype(np.uint64)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)


def test_bfloat16_weights_are_every_tensor_rounded_to_nearest() -> None:
    """The file MAX's Llama loads on a GPU (`--quantization-encoding bfloat16`): every
    tensor, the norms too, in bfloat16 (MAX checks each weight's dtype); added beside the
    float32 file when the directory exists (`add_weights`)."""
    float32_file = default_model_dir() / weights_file("float32")
    before = float32_file.stat() if float32_file.exists() else None
    directory = ensure_model_dir("bfloat16")
    if before is not None:  # added beside it, not by rewriting the directory
        after = float32_file.stat()
        assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)
    written = {t.name: t for t in gguf.GGUFReader(directory / weights_file("bfloat16")).tensors}
    source = {t.name: t for t in gguf.GGUFReader(smollm2_gguf_path()).tensors}
    assert written.keys() == source.keys()
    assert {t.tensor_type for t in written.values()} == {gguf.GGMLQuantizationType.BF16}
    for name in ("token_embd.weight", "blk.0.attn_k.weight", "output_norm.weight"):
        expected = _bfloat16_bits(gguf.quants.dequantize(source[name].data, source[name].tensor_type))
        got = np.asarray(written[name].data).view(np.uint16).reshape(expected.shape)
        np.testing.assert_array_equal(got, expected, err_msg=name)


def test_weights_are_added_only_to_a_model_directory_and_in_a_known_encoding(tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match=r"no config\.json"):
        add_weights(tmp_path, "bfloat16")
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="encoding must be one of float32, bfloat16, q4_0, got 'bf16'"):
        add_weights(tmp_path, "bf16")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json"]
