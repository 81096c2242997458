"""The GGUF's own byte-level BPE tokenizer and chat template, without a model hub.

The GGUF carries everything a tokenizer needs: ``tokenizer.ggml.tokens`` (id -> token string,
in GPT-2's byte-to-unicode alphabet), ``tokenizer.ggml.merges`` (ranked ``"a b"`` pairs),
``tokenizer.ggml.token_type`` (3 = control tokens such as ``<|im_start|>``), the EOS id and a
Jinja chat template. We rebuild the Hugging Face ``tokenizers`` pipeline from them:

* pre-tokenization: split every digit on its own, then GPT-2's byte-level regex without a
  prefix space (llama.cpp's ``smollm`` pre-tokenizer, which is what SmolLM2's tokenizer.json
  declares: ``Digits(individual_digits=True)`` + ``ByteLevel(add_prefix_space=False)``);
* model: BPE over the GGUF vocabulary and merges; decoder: byte-level;
* control tokens are registered as special tokens, so ``<|im_start|>`` in rendered chat text
  encodes to its single id. No BOS is added (``tokenizer.ggml.add_bos_token`` is false).

Opening the GGUF is slow (the reader parses every vocabulary string), so the built
tokenizer and its metadata are cached as one JSON file next to the GGUF.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import gguf
import numpy as np
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from mokv_models.model_files import derived_cache_path, smollm2_gguf_path

_CACHE_KIND = "tokenizer-v1.json"
_CONTROL_TOKEN_TYPE = 3  # llama.cpp's LLAMA_TOKEN_TYPE_CONTROL
# Metadata keys whose token ids end generation, when present.
_STOP_TOKEN_KEYS = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")


@dataclass(frozen=True)
class _TokenizerSpec:
    """What the GGUF says about its tokenizer; everything else is derived from it."""

    tokens: list[str]
    merges: list[str]
    control_token_ids: list[int]
    chat_template: str
    eos_token_id: int
    stop_token_ids: list[int]
    add_bos: bool


def _spec_from_gguf(path: Path) -> _TokenizerSpec:
    reader = gguf.GGUFReader(path)

    def get(key: str) -> object:
        field = reader.get_field(key)
        if field is None:
            raise KeyError(f"{path} has no {key!r} metadata")
        return field.contents()

    model = get("tokenizer.ggml.model")
    if model != "gpt2":
        raise ValueError(f"only byte-level BPE ('gpt2') tokenizers are supported, {path} has {model!r}")
    token_types = get("tokenizer.ggml.token_type")
    add_bos_field = reader.get_field("tokenizer.ggml.add_bos_token")
    return _TokenizerSpec(
        tokens=list(get("tokenizer.ggml.tokens")),
        merges=list(get("tokenizer.ggml.merges")),
        control_token_ids=[i for i, t in enumerate(token_types) if t == _CONTROL_TOKEN_TYPE],
        chat_template=str(get("tokenizer.chat_template")),
        eos_token_id=int(get("tokenizer.ggml.eos_token_id")),
        stop_token_ids=[int(get(k)) for k in _STOP_TOKEN_KEYS if reader.get_field(k) is not None],
        add_bos=bool(add_bos_field.contents()) if add_bos_field is not None else False,
    )


def _build_tokenizer(spec: _TokenizerSpec) -> Tokenizer:
    vocab = {token: i for i, token in enumerate(spec.tokens)}
    if len(vocab) != len(spec.tokens):
        raise ValueError(f"GGUF vocabulary has duplicate tokens: {len(spec.tokens) - len(vocab)} repeats")
    merges = [tuple(m.split(" ")) for m in spec.merges]
    bad = [m for m in merges if len(m) != 2]
    if bad:
        raise ValueError(f"merges must be 'left right' pairs, got {bad[:3]}")
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(spec.tokens[i], special=True, normalized=False) for i in spec.control_token_ids])
    return tok


class GGUFTokenizer:
    """Encode/decode text and render chats exactly as the GGUF's tokenizer metadata says."""

    def __init__(self, spec: _TokenizerSpec, tokenizer: Tokenizer) -> None:
        if spec.add_bos:
            raise ValueError("GGUF asks for a BOS token; this tokenizer only supports add_bos_token=false")
        self._spec = spec
        self._tok = tokenizer
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        self._template = env.from_string(spec.chat_template)

    @property
    def vocab_size(self) -> int:
        return len(self._spec.tokens)

    @property
    def eos_token_id(self) -> int:
        return self._spec.eos_token_id

    @property
    def chat_template(self) -> str:
        """The GGUF's Jinja chat template."""
        return self._spec.chat_template

    def to_json(self) -> str:
        """This tokenizer as Hugging Face `tokenizers` JSON (a `tokenizer.json`)."""
        return self._tok.to_str()

    @property
    def stop_token_ids(self) -> frozenset[int]:
        """Token ids that end a generation (EOS plus EOT/EOM where the GGUF declares them)."""
        return frozenset(self._spec.stop_token_ids)

    def encode(self, text: str) -> np.ndarray:
        """Token ids (int64, the graph's token dtype) of ``text``; no BOS is added.

        Control-token strings such as ``<|im_start|>`` in ``text`` map to their single ids.
        """
        return np.asarray(self._tok.encode(text, add_special_tokens=False).ids, dtype=np.int64)

    def decode(self, ids: Sequence[int] | np.ndarray, skip_special_tokens: bool = False) -> str:
        """Text of ``ids``; byte-level BPE makes ``decode(encode(s)) == s`` for any string."""
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: Sequence[Mapping[str, str]], add_generation_prompt: bool = True) -> str:
        """Render ``[{"role": ..., "content": ...}, ...]`` with the GGUF's Jinja template.

        Rendered like Hugging Face does (sandboxed, ``trim_blocks``, ``lstrip_blocks``); the
        SmolLM2 template inserts its default system prompt when the first message is not one.
        """
        for i, message in enumerate(messages):
            if set(message) != {"role", "content"}:
                raise ValueError(f"message {i} must have exactly 'role' and 'content', got {sorted(message)}")
        return self._template.render(
            messages=list(messages),
            add_generation_prompt=add_generation_prompt,
            eos_token=self._spec.tokens[self._spec.eos_token_id],
        )

    def encode_chat(self, messages: Sequence[Mapping[str, str]], add_generation_prompt: bool = True) -> np.ndarray:
        """Token ids of the rendered chat, ready to prefill."""
        return self.encode(self.apply_chat_template(messages, add_generation_prompt))


def load_tokenizer(gguf_path: Path | None = None) -> GGUFTokenizer:
    """The tokenizer of a GGUF (default: SmolLM2-135M-Instruct), cached as JSON after the first
    build (written to a temporary name and renamed, so a reader never sees half a file)."""
    path = Path(gguf_path) if gguf_path is not None else smollm2_gguf_path()
    cache = derived_cache_path(path, _CACHE_KIND)
    if cache.exists():
        blob = json.loads(cache.read_text())
        return GGUFTokenizer(_TokenizerSpec(**blob["spec"]), Tokenizer.from_str(blob["tokenizer"]))
    spec = _spec_from_gguf(path)
    tokenizer = _build_tokenizer(spec)
    tmp = cache.with_name(f"{cache.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"spec": asdict(spec), "tokenizer": tokenizer.to_str()}))
    tmp.replace(cache)
    return GGUFTokenizer(spec, tokenizer)
