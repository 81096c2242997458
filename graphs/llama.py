"""A ragged-batch Llama decoder as a MAX graph (float32, CPU), with pluggable attention.

Graph contract (``T`` = total tokens in the step, ``B`` = sequences; both symbolic, so one
compiled graph serves every batch shape):

inputs, in order
    ``tokens``            ``[T]`` int64: the step's token ids, sequences concatenated.
    ``input_row_offsets`` ``[B + 1]`` uint32: sequence ``b`` is rows ``offsets[b]:offsets[b+1]``;
                          ``offsets[0] == 0``, every sequence has at least one token.
    ``positions``         ``[T]`` int64: each token's absolute position in its own sequence
                          (``< config.context_length``), computed on the host.
    ``logit_rows``        ``[R]`` int64: the rows (of ``T``) whose logits are returned: each
                          sequence's last token when generating, every token when scoring.
    then the attention backend's ``input_types()``, in its order.
output
    ``[R, vocab_size]`` float32: logits of the ``logit_rows`` tokens, in that order.

Weights are graph :class:`~max.graph.Weight` s bound at load time (:func:`llama_weights_registry`:
the checkpoint's tensors under their GGUF names, the stacked block matrices of
``FUSED_PROJECTIONS`` and the RoPE tables ``rope.cos``/``rope.sin``),
each in its checkpoint encoding (``mokv_models.weight_formats``: float32, or GGUF blocks read by
mokv's kernels), not constants: a constant is serialized into the graph's IR on every build,
which for tables as large as RoPE's costs build time and IR size. RoPE uses the half-split form
(the checkpoint's Q/K rows are already in that order), with cos/sin computed in float64 on the
host and gathered by position.

The layers are built one after another, not as a shared subgraph (``ops.call``): for the CPU a
cold compile goes mostly to MAX's kernels for this graph rather than to each layer, so sharing
the layer would not shorten it. For a GPU it might: compiled for sm_90a (MAX's virtual device
mode, 2026-11-30), the dense and paged float32 graphs took 443 s with 30 layers and 225 s with 2.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
from max.dtype import DType
from max.engine import InferenceSession, Model
from max.graph import DeviceRef, Graph, TensorType, TensorValue, Weight, ops

from mokv.graph import GraphGroup, new_graph
from mokv_models.attention_backends import AttentionBackend
from mokv_models.gguf_model import LlamaCheckpoint, LlamaConfig
from mokv_models.weight_formats import declare_weight, embedding, linear, quant_kernel_package, uses_quant_kernels

CPU = DeviceRef.CPU()
TOTAL_TOKENS = "total_tokens"
ROW_OFFSETS_LEN = "input_row_offsets_len"
LOGIT_ROWS = "logit_rows"


def llama_input_types(device: DeviceRef = CPU) -> list[TensorType]:
    """The model's own graph inputs on ``device``: ``tokens``, ``input_row_offsets``,
    ``positions``, ``logit_rows``."""
    return [
        TensorType(DType.int64, [TOTAL_TOKENS], device=device),
        TensorType(DType.uint32, [ROW_OFFSETS_LEN], device=device),
        TensorType(DType.int64, [TOTAL_TOKENS], device=device),
        TensorType(DType.int64, [LOGIT_ROWS], device=device),
    ]


def rope_tables(config: LlamaConfig) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin of ``position * base^(-2i / head_dim)``, ``[context_length, head_dim // 2]``.

    Computed in float64 and rounded once, so long positions keep full float32 accuracy (an
    in-graph float32 ``position * freq`` is off by up to ~5e-4 rad at position 8k).
    """
    half = config.head_dim // 2
    inv_freq = config.rope_base ** (-np.arange(half, dtype=np.float64) * 2.0 / config.head_dim)
    angles = np.outer(np.arange(config.context_length, dtype=np.float64), inv_freq)
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


def _apply_rope(x: TensorValue, cos: TensorValue, sin: TensorValue) -> TensorValue:
    """Half-split RoPE of ``x`` ``[T, heads, D]`` with per-token ``cos``/``sin`` ``[T, 1, D/2]``."""
    half = int(x.shape[-1]) // 2
    x1, x2 = x[:, :, :half], x[:, :, half:]
    return ops.concat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


FUSED_PROJECTIONS = {"attn_qkv": ("attn_q", "attn_k", "attn_v"), "ffn_gate_up": ("ffn_gate", "ffn_up")}
"""Matrices of a layer that read the same input, by the name of their concatenation: in a
block format one product over the stacked rows replaces two or three (at batch 1 each product
is a kernel call with its own fixed cost: a graph op, and helpers queued on the runtime's
workers). Float32 weights stay apart, so the reference format is never copied."""


def fused_parts(encodings: Mapping[str, str], prefix: str, fused: str) -> list[str] | None:
    """The weight names that ``prefix + fused`` stacks, if they share one block encoding."""
    names = [f"{prefix}{part}.weight" for part in FUSED_PROJECTIONS[fused]]
    kinds = {encodings[name] for name in names}
    return names if len(kinds) == 1 and kinds != {"f32"} else None


class _LlamaWeights:
    """The graph's weights, each declared in its checkpoint encoding (see
    ``mokv_models.weight_formats``), with the products that read them."""

    def __init__(self, config: LlamaConfig, encodings: Mapping[str, str], device: DeviceRef) -> None:
        self.config = config
        self.encodings = encodings
        self.device = device
        self._declared: dict[str, Weight] = {}  # tied embeddings use one weight twice

    def _matrix(self, name: str, rows: int, columns: int) -> Weight:
        if name not in self._declared:
            self._declared[name] = declare_weight(name, self.encodings[name], rows, columns, self.device)
        return self._declared[name]

    def vector(self, name: str) -> Weight:
        """A float32 ``[hidden]`` weight (the RMS norms)."""
        return Weight(name, DType.float32, [self.config.hidden_size], self.device)

    def table(self, name: str, *shape: int) -> Weight:
        """A float32 table read by ``ops.gather`` (the RoPE tables)."""
        return Weight(name, DType.float32, list(shape), self.device)

    def linear(self, x: TensorValue, name: str, out_features: int) -> TensorValue:
        """``x @ W.T`` for the ``[out_features, x.shape[-1]]`` matrix ``name``."""
        return linear(x, self._matrix(name, out_features, int(x.shape[-1])), self.encodings[name])

    def projections(self, x: TensorValue, prefix: str, fused: str, sizes: Sequence[int]) -> list[TensorValue]:
        """The products of ``x`` with the layer's ``FUSED_PROJECTIONS[fused]`` matrices
        (``sizes[i]`` rows each): one product over their stacked rows where they share a block
        encoding (``fused_parts``), else one each."""
        names = fused_parts(self.encodings, prefix, fused)
        if names is None:
            parts = FUSED_PROJECTIONS[fused]
            return [self.linear(x, f"{prefix}{part}.weight", n) for part, n in zip(parts, sizes, strict=True)]
        name = f"{prefix}{fused}.weight"
        if name not in self._declared:
            encoding = self.encodings[names[0]]
            self._declared[name] = declare_weight(name, encoding, sum(sizes), int(x.shape[-1]), self.device)
        stacked = linear(x, self._declared[name], self.encodings[names[0]])
        return list(ops.split(stacked, list(sizes), axis=1))

    def embed(self, tokens: TensorValue) -> TensorValue:
        c = self.config
        table = self._matrix("token_embd.weight", c.vocab_size, c.hidden_size)
        return embedding(table, tokens, self.encodings["token_embd.weight"], c.hidden_size)


def build_llama_graph(
    config: LlamaConfig,
    attention: AttentionBackend,
    encodings: Mapping[str, str],
    name: str = "llama",
    device: DeviceRef = CPU,
    group: GraphGroup | None = None,
) -> Graph:
    """The Llama decoder graph of ``config`` with ``attention`` (see the module contract),
    reading each weight in its ``encodings`` entry, its inputs and weights on ``device``,
    built into ``group`` when given (graphs of one weight format can share a group: their
    weights have the same names)."""
    c = config
    w = _LlamaWeights(config, encodings, device)
    input_types = [*llama_input_types(device), *attention.input_types()]
    extensions = list(attention.custom_extensions)
    if uses_quant_kernels(encodings):
        extensions.append(quant_kernel_package())
    with new_graph(name, input_types, extensions, group) as graph:
        tokens, row_offsets, positions, logit_rows, *backend_inputs = graph.inputs
        tokens, row_offsets, positions = tokens.tensor, row_offsets.tensor, positions.tensor
        total = tokens.shape[0]

        h = w.embed(tokens)  # [T, hidden]
        rope_shape = (c.context_length, c.head_dim // 2)
        cos = ops.unsqueeze(ops.gather(w.table("rope.cos", *rope_shape), positions, axis=0), 1)
        sin = ops.unsqueeze(ops.gather(w.table("rope.sin", *rope_shape), positions, axis=0), 1)
        kv_dim = c.n_kv_heads * c.head_dim

        for i in range(c.n_layers):
            p = f"blk.{i}."
            x = ops.rms_norm(h, w.vector(p + "attn_norm.weight"), c.rms_norm_eps)
            q, k, v = w.projections(x, p, "attn_qkv", [c.hidden_size, kv_dim, kv_dim])
            q = ops.reshape(q, [total, c.n_heads, c.head_dim])
            k = ops.reshape(k, [total, c.n_kv_heads, c.head_dim])
            v = ops.reshape(v, [total, c.n_kv_heads, c.head_dim])
            attn = attention(i, _apply_rope(q, cos, sin), _apply_rope(k, cos, sin), v, row_offsets, backend_inputs)
            h = h + w.linear(ops.reshape(attn, [total, c.hidden_size]), p + "attn_output.weight", c.hidden_size)

            x = ops.rms_norm(h, w.vector(p + "ffn_norm.weight"), c.rms_norm_eps)
            gate, up = w.projections(x, p, "ffn_gate_up", [c.ffn_hidden_size, c.ffn_hidden_size])
            h = h + w.linear(ops.silu(gate) * up, p + "ffn_down.weight", c.hidden_size)

        last = ops.rms_norm(ops.gather(h, logit_rows.tensor, axis=0), w.vector("output_norm.weight"), c.rms_norm_eps)
        graph.output(w.linear(last, c.lm_head_name, c.vocab_size))
    return graph


def llama_weights_registry(checkpoint: LlamaCheckpoint) -> dict[str, np.ndarray]:
    """Every array the graph's weights are bound to, by weight name."""
    cos, sin = rope_tables(checkpoint.config)
    weights = {**checkpoint.weights, "rope.cos": cos, "rope.sin": sin}
    for i in range(checkpoint.config.n_layers):
        for fused in FUSED_PROJECTIONS:
            names = fused_parts(checkpoint.encodings, f"blk.{i}.", fused)
            if names is not None:  # block rows stack as they are: each row is its own blocks
                weights[f"blk.{i}.{fused}.weight"] = np.concatenate([weights.pop(n) for n in names])
    return weights


def load_llama_model(
    session: InferenceSession, checkpoint: LlamaCheckpoint, attention: AttentionBackend, device: DeviceRef = CPU
) -> Model:
    """Build and compile the graph on ``device`` and bind its weights. On the CPU MAX aliases the
    arrays rather than copying them, so the checkpoint's memory-mapped files must outlive the
    model."""
    graph = build_llama_graph(checkpoint.config, attention, checkpoint.encodings, device=device)
    return session.load(graph, weights_registry=llama_weights_registry(checkpoint))


@dataclass(frozen=True)
class RaggedBatch:
    """The model's own inputs for one step, in graph-input order."""

    tokens: np.ndarray  # [T] int64
    input_row_offsets: np.ndarray  # [B + 1] uint32
    positions: np.ndarray  # [T] int64
    logit_rows: np.ndarray  # [R] int64

    def inputs(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        return self.tokens, self.input_row_offsets, self.positions, self.logit_rows


def last_token_rows(input_row_offsets: np.ndarray) -> np.ndarray:
    """``logit_rows`` selecting each sequence's last token."""
    return input_row_offsets[1:].astype(np.int64) - 1


def ragged_batch(
    chunks: Sequence[np.ndarray],
    start_positions: Sequence[int] | None = None,
    *,
    context_length: int,
    all_logits: bool = False,
) -> RaggedBatch:
    """Concatenate per-sequence token chunks into the graph's ragged inputs.

    ``start_positions[b]`` is the position of chunk ``b``'s first token (the number of tokens
    of that sequence already processed, e.g. in a KV cache); all zeros when omitted, as for
    the cache-free backend, which always sees whole sequences. The step returns the logits of
    each chunk's last token, or with ``all_logits`` of every token.
    """
    if not chunks:
        raise ValueError("a batch needs at least one sequence")
    lengths = np.array([len(c) for c in chunks], dtype=np.int64)
    if (lengths == 0).any():
        raise ValueError(f"every sequence needs at least one token; lengths are {lengths.tolist()}")
    starts = np.zeros(len(chunks), np.int64) if start_positions is None else np.asarray(start_positions, np.int64)
    if starts.shape != lengths.shape or (starts < 0).any():
        raise ValueError(f"start_positions must be {len(chunks)} non-negative ints, got {starts.tolist()}")
    ends = starts + lengths
    if (ends > context_length).any():
        raise ValueError(f"sequence end positions {ends.tolist()} exceed context_length {context_length}")
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    positions = np.arange(offsets[-1], dtype=np.int64) + np.repeat(starts - offsets[:-1], lengths)
    tokens = np.concatenate([np.asarray(c, dtype=np.int64) for c in chunks])
    offsets = offsets.astype(np.uint32)
    rows = np.arange(len(tokens), dtype=np.int64) if all_logits else last_token_rows(offsets)
    return RaggedBatch(tokens, offsets, positions, rows)
