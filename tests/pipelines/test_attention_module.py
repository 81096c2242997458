"""mokv's `max.nn` attention layers against MAX's own, side by side in one graph
on the buffers of MAX's own `PagedKVCacheManager`.

One compiled graph holds three pairs of layers, each pair built from the same
constructor arguments and loaded with the same weights: MAX's
`AttentionWithRope` with interleaved RoPE (as MAX's Llama runs GGUF
checkpoints) and with half-split RoPE (safetensors checkpoints), and MAX's
`GGUFQAttentionWithRope` on q4_0 weights; each next to its mokv twin
(`to_mokv`). The pairs write layers (0, 1), (2, 3) and (4, 5) of one MAX cache,
so every step checks both what a layer returns and the roped keys and values
it stored, at the same pages and positions, against MAX's kernels.

Tolerance (`TOLERANCE`, per pair): the float32 pairs compute in float32 from
the same weights and differ only in the summation order of the flash
attention's softmax, so outputs of order 1 agree to ~1e-6 (2e-5 leaves a
margin). The q4_0 pair's projections differ beyond that: MAX's layer runs its
fused GGUF QKV kernel, mokv's `ops.qmatmul`, and both round the activations to
8-bit blocks, not identically (some rows agree exactly, others by up to ~9e-4),
so 3e-3 holds them; its cache work is the float32 pairs' code.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
from max import tree
from max.driver import Buffer
from max.dtype import DType
from max.graph import DeviceRef, Graph, Shape, TensorType, ops
from max.graph.quantization import QuantizationEncoding
from max.graph.weights import WeightData
from max.nn.attention import AttentionWithRope, GGUFQAttentionWithRope
from max.nn.kv_cache import MHAKVCacheParams
from max.nn.kv_cache.cache_params import contiguous_page_view_and_stride
from max.nn.layer import LayerList
from max.nn.rotary_embedding import RotaryEmbedding

from mokv.pipelines.attention import MokvAttentionWithRope, MokvGGUFQAttentionWithRope, to_mokv

pytest.importorskip("max.pipelines.context")
gguf = pytest.importorskip("gguf")

from max.pipelines.context import TextContext, TokenBuffer  # noqa: E402
from max.pipelines.kv_cache import PagedKVCacheManager  # noqa: E402
from max.pipelines.modeling.types import RequestID  # noqa: E402

pytestmark = pytest.mark.slow

CPU = DeviceRef.CPU()
HIDDEN, N_HEADS, N_KV_HEADS, HEAD_DIM = 576, 9, 3, 64  # SmolLM2-135M's attention: GQA, 3 query heads per KV head
PAGE_SIZE, PAGES, MAX_SEQ_LEN = 16, 24, 256
PAIRS = ("interleaved", "half_split", "q4_0")
TOLERANCE = {"interleaved": 2e-5, "half_split": 2e-5, "q4_0": 3e-3}
"""Absolute and relative tolerance of each pair (see the module docstring)."""


def _params() -> MHAKVCacheParams:
    return MHAKVCacheParams(
        dtype=DType.float32,
        n_kv_heads=N_KV_HEADS,
        head_dim=HEAD_DIM,
        num_layers=2 * len(PAIRS),
        page_size=PAGE_SIZE,
        devices=[CPU],
    )


def _layer(pair: str) -> AttentionWithRope:
    interleaved = pair != "half_split"
    rope = RotaryEmbedding(HIDDEN, N_HEADS, 100000.0, MAX_SEQ_LEN, head_dim=HEAD_DIM, interleaved=interleaved)
    shape = {
        "rope": rope,
        "num_attention_heads": N_HEADS,
        "num_key_value_heads": N_KV_HEADS,
        "hidden_size": HIDDEN,
        "kv_params": _params(),
    }
    if pair == "q4_0":
        return GGUFQAttentionWithRope(**shape, dtype=DType.uint8, quantization_encoding=QuantizationEncoding.Q4_0)
    return AttentionWithRope(**shape)


def _weights(layer: AttentionWithRope, rng: np.random.Generator) -> dict[str, np.ndarray | WeightData]:
    """Random weights for every weight of `layer` (q4_0 blocks for a GGUF layer)."""
    q_dim, kv_dim = N_HEADS * HEAD_DIM, N_KV_HEADS * HEAD_DIM
    rows = {"q_proj.weight": q_dim, "k_proj.weight": kv_dim, "v_proj.weight": kv_dim, "o_proj.weight": HIDDEN}
    out = {}
    for name in layer.raw_state_dict():
        columns = q_dim if name == "o_proj.weight" else HIDDEN
        w = (rng.standard_normal((rows[name], columns)) / math.sqrt(columns)).astype(np.float32)
        if isinstance(layer, GGUFQAttentionWithRope):
            blocks = gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q4_0)
            w = WeightData(blocks, name, DType.uint8, Shape(blocks.shape), QuantizationEncoding.Q4_0)
        out[name] = w
    return out


@pytest.fixture(scope="module")
def paired_layers(session, kernels):
    """The graph `(x, input_row_offsets, *MAX's cache inputs) -> one output per
    layer`, layer 2p being MAX's and 2p + 1 mokv's of pair p, compiled once."""
    rng = np.random.default_rng(7)
    built: list[AttentionWithRope] = []
    weights: dict[str, np.ndarray | WeightData] = {}
    for p, pair in enumerate(PAIRS):
        theirs, ours = _layer(pair), to_mokv(_layer(pair))
        pair_weights = _weights(theirs, rng)
        for i, layer in ((2 * p, theirs), (2 * p + 1, ours)):
            built.append(layer)
            weights.update({f"{i}.{name}": w for name, w in pair_weights.items()})
    layers = LayerList(built)
    assert [type(layer) for layer in layers][1::2] == [MokvAttentionWithRope] * 2 + [MokvGGUFQAttentionWithRope]
    layers.load_state_dict(weights, override_quantization_encoding=True, weight_alignment=1)
    params = _params()
    input_types = [
        TensorType(DType.float32, ["total_tokens", HIDDEN], CPU),
        TensorType(DType.uint32, ["batch_plus_one"], CPU),
        *params.flattened_kv_inputs(),
    ]
    with Graph("mokv_vs_max_attention", input_types=input_types, custom_extensions=[kernels]) as graph:
        x, offsets, *kv = graph.inputs
        (cache,) = params.unflatten_kv_inputs(iter(kv))
        graph.output(
            *(
                layer(ops.constant(i, DType.uint32, CPU), x.tensor, cache, layer.rope.freqs_cis, offsets.tensor)
                for i, layer in enumerate(layers)
            )
        )
    return session.load(graph, weights_registry=layers.state_dict())


@pytest.fixture
def manager(session) -> PagedKVCacheManager:
    """A fresh MAX manager over a zeroed cache (the reference's own buffers)."""
    return PagedKVCacheManager(params=_params(), total_num_pages=PAGES, session=session, max_batch_size=4)


def _request(manager: PagedKVCacheManager, name: str, prompt_length: int) -> TextContext:
    ctx = TextContext(
        request_id=RequestID(name), max_length=MAX_SEQ_LEN, tokens=TokenBuffer(np.arange(prompt_length, dtype=np.int64))
    )
    manager.claim(ctx)
    return ctx


def _forward(model, manager: PagedKVCacheManager, batch: list[TextContext], rng, kv_inputs=None) -> list[np.ndarray]:
    """One forward of `batch` (its active tokens, random hidden states) through
    every layer on the manager's cache; then each request takes a token."""
    for ctx in batch:
        manager.alloc(ctx)
    inputs = kv_inputs if kv_inputs is not None else tree.leaves(manager.runtime_inputs([batch]))
    lengths = [ctx.tokens.active_length for ctx in batch]
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.uint32)
    x = rng.standard_normal((int(offsets[-1]), HIDDEN)).astype(np.float32)
    outs = [o.to_numpy() for o in model.execute(Buffer.from_numpy(x), Buffer.from_numpy(offsets), *inputs)]
    for ctx in batch:
        ctx.update(7)
        manager.step(ctx)
    return outs


def _blocks(manager: PagedKVCacheManager) -> np.ndarray:
    return manager.get_device_buffer(0).values[0].to_numpy()


def _check_step(model, manager: PagedKVCacheManager, batch: list[TextContext], rng, what: str) -> None:
    """One forward: each mokv layer returns what its MAX twin returns."""
    outs = _forward(model, manager, batch, rng)
    for p, pair in enumerate(PAIRS):
        tol = TOLERANCE[pair]
        np.testing.assert_allclose(outs[2 * p + 1], outs[2 * p], atol=tol, rtol=tol, err_msg=f"{pair}, {what}")


def test_prefill_and_decode_steps_match_max_on_its_own_cache(paired_layers, manager) -> None:
    """Prompts crossing page boundaries, decode steps, and a prompt joining a
    decoding batch: every pair returns the same heads and stores the same keys
    and values at the same slots."""
    rng = np.random.default_rng(0)
    a, b = _request(manager, "a", 37), _request(manager, "b", 20)  # 3 and 2 pages of 16
    _check_step(paired_layers, manager, [a, b], rng, "prefill")
    _check_step(paired_layers, manager, [a, b], rng, "decode 1")
    _check_step(paired_layers, manager, [a, b], rng, "decode 2")
    c = _request(manager, "c", 23)
    _check_step(paired_layers, manager, [a, c, b], rng, "c prefills beside a and b decoding")
    _check_step(paired_layers, manager, [c, b, a], rng, "decode 3")
    blocks = _blocks(manager)
    written = sum(ctx.tokens.processed_length for ctx in (a, b, c))
    for p, pair in enumerate(PAIRS):
        theirs, ours = blocks[:, :, 2 * p], blocks[:, :, 2 * p + 1]
        np.testing.assert_allclose(ours, theirs, atol=TOLERANCE[pair], rtol=TOLERANCE[pair], err_msg=pair)
        # every token written once, as a key row and a value row of every KV head
        assert np.count_nonzero(np.abs(ours).sum(axis=-1)) == 2 * N_KV_HEADS * written, pair


def test_non_packed_page_stride_is_refused_naming_it(paired_layers, manager) -> None:
    """MAX's padded page view of a shared slab (what its Jenga pool binds when
    cache groups share memory): MAX's layers read it at the stride, mokv's
    refuse the step with an error naming `page_stride`."""
    params = _params()
    shape = params.shape_per_block
    page_bytes = math.prod(shape) * 4
    slab = Buffer.from_numpy(np.zeros((PAGES + 1) * (page_bytes + 256), np.uint8))
    view, stride = contiguous_page_view_and_stride(slab, shape, DType.float32, page_bytes + 256)
    assert stride == (page_bytes + 256) // 4
    a = _request(manager, "a", 20)
    manager.alloc(a)
    (device,) = manager.runtime_inputs([[a]])
    padded = dataclasses.replace(device, kv_blocks=view, page_stride=Buffer.from_numpy(np.array([stride], np.int64)))
    with pytest.raises(ValueError, match=r"page_stride is not -1 \(packed pages\)"):
        _forward(paired_layers, manager, [a], np.random.default_rng(1), tree.leaves((padded,)))
