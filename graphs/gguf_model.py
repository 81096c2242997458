"""Llama hyper-parameters and weights from a GGUF file, cached as ``.npy`` files.

Two weight formats (``mokv_models.weight_formats``): ``f32`` dequantizes every tensor to
float32; ``gguf`` keeps each tensor's own GGUF blocks (SmolLM2: Q4_1 layers, a Q8_0 embedding,
F32 norms) as ``uint8`` rows ``[out_features, blocks * block_bytes]``, each row planar. Reading
a GGUF is slow (the ``gguf`` reader parses every vocabulary string one by one) and so is
dequantizing it, so the first load of a format writes every tensor to
``<cache>/models/<gguf stem>.<bytes>.<format>-v<version>/`` as one ``.npy`` each, plus
``config.json``.
Later loads memory-map those files read-only (nothing is read up front: the memory pages come
in as the graph or the numpy reference touches them, and are shared between processes).

Weight naming and layout: tensors keep their GGUF names (``token_embd.weight``,
``blk.{i}.attn_q.weight``, ``output_norm.weight``, ...); matrices are ``[out_features,
in_features]`` (so a projection is ``x @ w.T``, as in PyTorch and ``max.nn.Linear``), and a
block row holds the same weights as the float32 row it dequantizes to.

RoPE layout: llama.cpp's converter permutes the rows of ``attn_q``/``attn_k`` inside every head
so that its RoPE can rotate adjacent pairs ``(2i, 2i+1)``. We undo that permutation here, so
the weights are in the Hugging Face order and the graph uses the *half-split* RoPE form
(rotate ``x[i]`` with ``x[i + head_dim/2]``). Every consumer of :func:`load_llama` gets
half-split weights; the numpy reference re-applies the permutation on its own to check this.
The permutation moves whole rows, so it applies to rows of blocks just as well.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path

import gguf
import numpy as np

from mokv_models.model_files import derived_cache_path, smollm2_gguf_path
from mokv_models.weight_formats import BLOCK_ENCODINGS, WEIGHT_FORMATS

_CACHE_VERSIONS = {"f32": 1, "gguf": 2}
"""Bumped per weight format when its cached file layout or the transformation of its weights
changes (``gguf`` 2: block rows planar). Writing a version deletes the earlier ones."""
_CONFIG_FILE = "config.json"


@dataclass(frozen=True)
class LlamaConfig:
    """The hyper-parameters a Llama decoder graph needs, read from GGUF metadata."""

    n_layers: int
    hidden_size: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn_hidden_size: int
    rope_base: float
    rms_norm_eps: float
    vocab_size: int
    context_length: int
    tied_embeddings: bool

    def __post_init__(self) -> None:
        if self.n_heads * self.head_dim != self.hidden_size:
            raise ValueError(
                f"n_heads * head_dim must equal hidden_size: {self.n_heads} * {self.head_dim} != {self.hidden_size}"
            )
        if self.n_heads % self.n_kv_heads != 0:
            raise ValueError(f"n_heads ({self.n_heads}) must be a multiple of n_kv_heads ({self.n_kv_heads})")
        if self.head_dim % 2 != 0:
            raise ValueError(f"RoPE needs an even head_dim, got {self.head_dim}")

    @property
    def lm_head_name(self) -> str:
        """Name of the LM-head weight: the embedding itself when embeddings are tied."""
        return "token_embd.weight" if self.tied_embeddings else "output.weight"


@dataclass(frozen=True)
class LlamaCheckpoint:
    """A config with its weights (GGUF names, half-split RoPE row order) in one weight format.

    ``encodings[name]`` says how ``weights[name]`` is stored: ``"f32"``, or a block encoding
    of ``mokv_models.weight_formats.BLOCK_ENCODINGS`` (``uint8`` rows of blocks).
    """

    config: LlamaConfig
    weights: Mapping[str, np.ndarray]
    encodings: Mapping[str, str]
    weight_format: str = "f32"


def _field(reader: gguf.GGUFReader, key: str) -> object:
    field = reader.get_field(key)
    if field is None:
        raise KeyError(f"GGUF metadata has no {key!r}")
    return field.contents()


def config_from_gguf(reader: gguf.GGUFReader) -> LlamaConfig:
    """Build a :class:`LlamaConfig` from the ``llama.*`` metadata of an open GGUF."""
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise ValueError(f"expected a llama GGUF, got general.architecture={arch!r}")
    n_heads = int(_field(reader, "llama.attention.head_count"))
    hidden = int(_field(reader, "llama.embedding_length"))
    head_dim = hidden // n_heads
    if reader.get_field("llama.attention.key_length") is not None:
        head_dim = int(_field(reader, "llama.attention.key_length"))
    rope_dims = int(_field(reader, "llama.rope.dimension_count"))
    if rope_dims != head_dim:
        raise ValueError(f"partial RoPE is not supported: rope.dimension_count={rope_dims}, head_dim={head_dim}")
    tensor_names = {t.name for t in reader.tensors}
    return LlamaConfig(
        n_layers=int(_field(reader, "llama.block_count")),
        hidden_size=hidden,
        n_heads=n_heads,
        n_kv_heads=int(_field(reader, "llama.attention.head_count_kv")),
        head_dim=head_dim,
        ffn_hidden_size=int(_field(reader, "llama.feed_forward_length")),
        rope_base=float(_field(reader, "llama.rope.freq_base")),
        rms_norm_eps=float(_field(reader, "llama.attention.layer_norm_rms_epsilon")),
        vocab_size=int(_field(reader, "llama.vocab_size")),
        context_length=int(_field(reader, "llama.context_length")),
        tied_embeddings="output.weight" not in tensor_names,
    )


def unpermute_rope_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's per-head row permutation of a Q or K projection ``[out, in]``.

    The converter maps Hugging Face row ``s * half + j`` of each head (``s`` in {0, 1}) to GGUF
    row ``2 * j + s``; this is the inverse, giving rows that suit half-split RoPE.
    """
    if w.shape[0] % (2 * n_heads) != 0:
        raise ValueError(f"cannot split {w.shape[0]} rows into {n_heads} heads of pairs")
    half = w.shape[0] // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _half_split_rows(name: str, w: np.ndarray, config: LlamaConfig) -> np.ndarray:
    """``w`` with Q/K rows reordered for half-split RoPE; other tensors as they are."""
    if name.endswith("attn_q.weight"):
        return unpermute_rope_rows(w, config.n_heads)
    if name.endswith("attn_k.weight"):
        return unpermute_rope_rows(w, config.n_kv_heads)
    return w


def dequantize_gguf(reader: gguf.GGUFReader, config: LlamaConfig) -> LlamaCheckpoint:
    """All tensors as float32 ``[out, in]`` arrays, Q/K rows reordered for half-split RoPE."""
    weights: dict[str, np.ndarray] = {}
    for tensor in reader.tensors:
        w = np.ascontiguousarray(gguf.quants.dequantize(tensor.data, tensor.tensor_type), np.float32)
        weights[tensor.name] = _half_split_rows(tensor.name, w, config)
    return LlamaCheckpoint(config, weights, dict.fromkeys(weights, "f32"), "f32")


def gguf_blocks(reader: gguf.GGUFReader, config: LlamaConfig) -> LlamaCheckpoint:
    """Every tensor as the GGUF stores it: float32 tensors as float32, block encodings as
    ``uint8`` rows of blocks, each row planar (``BlockEncoding.planar``); Q/K rows reordered
    for half-split RoPE."""
    weights: dict[str, np.ndarray] = {}
    encodings: dict[str, str] = {}
    for tensor in reader.tensors:
        encoding = tensor.tensor_type.name.lower()
        if encoding not in BLOCK_ENCODINGS and encoding != "f32":
            known = ", ".join(["F32", *(e.upper() for e in BLOCK_ENCODINGS)])
            raise ValueError(f"tensor {tensor.name} is {tensor.tensor_type.name}; mokv reads {known}")
        rows = _half_split_rows(tensor.name, np.asarray(tensor.data), config)
        if encoding in BLOCK_ENCODINGS:
            rows = BLOCK_ENCODINGS[encoding].planar(rows)
        weights[tensor.name] = np.ascontiguousarray(rows)
        encodings[tensor.name] = encoding
    return LlamaCheckpoint(config, weights, encodings, "gguf")


_CONVERTERS = {"f32": dequantize_gguf, "gguf": gguf_blocks}


def _read_cache(cache_dir: Path) -> LlamaCheckpoint | None:
    config_file = cache_dir / _CONFIG_FILE
    if not config_file.exists():
        return None
    meta = json.loads(config_file.read_text())
    weights = {name: np.load(cache_dir / f"{name}.npy", mmap_mode="r") for name in meta["tensors"]}
    encodings = meta.get("encodings", dict.fromkeys(weights, "f32"))
    return LlamaCheckpoint(LlamaConfig(**meta["config"]), weights, encodings, meta.get("weight_format", "f32"))


def _write_cache(cache_dir: Path, checkpoint: LlamaCheckpoint) -> None:
    """Write into a private temporary folder and rename it into place, so readers never see
    a half-written cache (``config.json``, which marks it complete, is written last)."""
    tmp = cache_dir.with_name(f"{cache_dir.name}.{os.getpid()}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for name, w in checkpoint.weights.items():
        np.save(tmp / f"{name}.npy", w)
    meta = {
        "config": asdict(checkpoint.config),
        "tensors": sorted(checkpoint.weights),
        "encodings": dict(checkpoint.encodings),
        "weight_format": checkpoint.weight_format,
    }
    (tmp / _CONFIG_FILE).write_text(json.dumps(meta, indent=1))
    shutil.rmtree(cache_dir, ignore_errors=True)  # only a damaged cache (no config.json) is here
    try:
        tmp.rename(cache_dir)
    except OSError:  # another process renamed the same cache into place first: keep theirs
        shutil.rmtree(tmp, ignore_errors=True)


def _cache_kind(weights: str, version: int) -> str:
    return f"{weights}-v{version}"


def load_llama(
    gguf_path: Path | None = None, weights: str = "f32", log: Callable[[str], None] | None = None
) -> LlamaCheckpoint:
    """Config and weights of a llama GGUF (default: SmolLM2-135M-Instruct) in weight format
    ``weights`` (``"f32"`` or ``"gguf"``).

    The first call per GGUF and format converts it and writes the ``.npy`` cache (saying so
    through ``log``, as it takes several seconds); later calls memory-map it. The returned
    arrays are read-only.
    """
    if weights not in WEIGHT_FORMATS:
        raise ValueError(f"unknown weight format {weights!r}; choose one of {', '.join(WEIGHT_FORMATS)}")
    path = Path(gguf_path) if gguf_path is not None else smollm2_gguf_path()
    cache_dir = derived_cache_path(path, _cache_kind(weights, _CACHE_VERSIONS[weights]))
    cached = _read_cache(cache_dir)
    if cached is not None:
        return cached
    if log is not None:
        log(f"converting {path.name} to {weights} weights in {cache_dir} (once; about 10 s)...")
    reader = gguf.GGUFReader(path)
    _write_cache(cache_dir, _CONVERTERS[weights](reader, config_from_gguf(reader)))
    for version in range(1, _CACHE_VERSIONS[weights]):  # layouts this code no longer reads
        shutil.rmtree(derived_cache_path(path, _cache_kind(weights, version)), ignore_errors=True)
    # Read back rather than return the arrays just built: every caller then gets the same
    # read-only memory maps, and the freshly converted arrays are freed.
    cached = _read_cache(cache_dir)
    if cached is None:
        raise RuntimeError(f"weight cache {cache_dir} has no {_CONFIG_FILE} right after being written")
    return cached
