"""mokv_weights's block kernels against numpy: the matmul over Q4_1 / Q8_0 blocks
within float32 summation error of `x @ w.T` (w as `gguf` dequantizes it), and the
embedding lookup equal to `gguf`'s own dequantization. Blocks are made by `gguf`'s
quantizer from random weights and passed as the model loader passes them (rows planar)."""

from __future__ import annotations

from typing import NamedTuple

import gguf
import numpy as np
import pytest
from max.driver import Buffer
from max.dtype import DType
from max.engine import InferenceSession, Model
from max.graph import DeviceRef, Graph, TensorType, ops

from mokv_models.weight_formats import BLOCK_ENCODINGS, declare_weight, quant_kernel_package

CPU = DeviceRef.CPU()
GGML_TYPES = {"q4_1": gguf.GGMLQuantizationType.Q4_1, "q8_0": gguf.GGMLQuantizationType.Q8_0}


@pytest.fixture(scope="module")
def quant_graph(session: InferenceSession) -> Model:
    """One graph, every dim symbolic: `(x, w_q4_1, w_q8_0, ids) -> (x @ w_q4_1.T, x @ w_q8_0.T,
    rows ids of w_q4_1, rows ids of w_q8_0)`."""
    x_type = TensorType(DType.float32, ["m", "k"], CPU)
    w_types = [TensorType(DType.uint8, [f"rows_{e}", f"row_bytes_{e}"], CPU) for e in BLOCK_ENCODINGS]
    with Graph(
        "quant_kernels",
        input_types=[x_type, *w_types, TensorType(DType.int64, ["ids"], CPU)],
        custom_extensions=[quant_kernel_package()],
    ) as graph:
        x, *weights, ids = (v.tensor for v in graph.inputs)
        outputs = []
        for encoding, w in zip(BLOCK_ENCODINGS, weights, strict=True):
            outputs.append(
                ops.custom(
                    "mokv_quant.matmul",
                    CPU,
                    [x, w],
                    [TensorType(DType.float32, [x.shape[0], w.shape[0]], CPU)],
                    parameters={"encoding": encoding},
                )[0]
            )
        for encoding, w in zip(BLOCK_ENCODINGS, weights, strict=True):
            outputs.append(
                ops.custom(
                    "mokv_quant.gather_rows",
                    CPU,
                    [w, ids],
                    [TensorType(DType.float32, [ids.shape[0], x.shape[1]], CPU)],
                    parameters={"encoding": encoding},
                )[0]
            )
        graph.output(*outputs)
    return session.load(graph)


class Blocks(NamedTuple):
    """Random weights quantized by gguf: the planar rows the kernels read, the float32
    values gguf decodes them to, and each weight's terms' magnitude `|d q| + |m|`."""

    planar: np.ndarray
    exact: np.ndarray
    magnitude: np.ndarray


def _blocks(encoding: str, rows: int, columns: int, seed: int) -> Blocks:
    w = np.random.default_rng(seed).standard_normal((rows, columns)).astype(np.float32)
    blocks = gguf.quants.quantize(w, GGML_TYPES[encoding])
    per_block = blocks.reshape(rows, columns // 32, -1)
    d = np.abs(per_block[:, :, 0:2].copy().view(np.float16).astype(np.float64))
    if encoding == "q4_1":
        m = np.abs(per_block[:, :, 2:4].copy().view(np.float16).astype(np.float64))
        packed = per_block[:, :, 4:]
        q = np.concatenate([packed & 15, packed >> 4], axis=2).astype(np.float64)
    else:
        m = np.zeros_like(d)
        q = np.abs(per_block[:, :, 2:].copy().view(np.int8).astype(np.float64))
    magnitude = (d * q + m).reshape(rows, columns)
    exact = gguf.quants.dequantize(blocks, GGML_TYPES[encoding]).astype(np.float64)
    return Blocks(BLOCK_ENCODINGS[encoding].planar(blocks), exact, magnitude)


def _summation_bound(x: np.ndarray, magnitude: np.ndarray) -> np.ndarray:
    """The float32 rounding error a `k`-term dot product may carry, `(k + 4) * u * sum|x| (|d q| + |m|)`
    (u = 2^-24): the kernels sum `d q x` and `m x` terms, whether fused per weight (`(d q + m) x`)
    or per block (`d (q . x) + m sum(x)`); the 4 covers the fused and per-block roundings."""
    return (x.shape[1] + 4) * 2.0**-24 * (np.abs(x) @ magnitude.T)


def _run(model: Model, x: np.ndarray, weights: dict[str, np.ndarray], ids: np.ndarray) -> list[np.ndarray]:
    args = [x, *(weights[e] for e in BLOCK_ENCODINGS), ids]
    return [o.to_numpy() for o in model.execute(*(Buffer.from_numpy(np.ascontiguousarray(a)) for a in args))]


@pytest.mark.parametrize(
    ("m", "n", "k"),
    [
        (1, 8, 32),
        (1, 20, 96),
        (1, 12, 576),
        (1, 16, 1056),
        (3, 24, 64),
        (4, 16, 96),
        (5, 40, 64),
        (13, 32, 576),
        (33, 4, 32),
        # Weights whose rows leave the last register block short (blocks of 2 rows of w up to
        # 6 rows of x, of 3 over the dequantized panel beyond).
        (1, 7, 64),
        (6, 9, 96),
        (7, 1, 32),
        # Products big enough to be cut into parallel items, the last one short.
        (1, 1028, 576),
        (16, 132, 576),
        (16, 131, 576),
    ],
)
def test_matmul_is_the_float32_product_of_the_dequantized_weights(quant_graph: Model, m: int, n: int, k: int) -> None:
    rng = np.random.default_rng(m * 1000 + n + k)
    x = (rng.standard_normal((m, k)) * rng.uniform(0.1, 10, (m, 1))).astype(np.float32)
    made = {e: _blocks(e, n, k, seed=i + k) for i, e in enumerate(BLOCK_ENCODINGS)}
    outputs = _run(quant_graph, x, {e: b.planar for e, b in made.items()}, np.zeros(1, np.int64))
    for encoding, y in zip(BLOCK_ENCODINGS, outputs, strict=False):
        expected = x.astype(np.float64) @ made[encoding].exact.T
        bound = _summation_bound(x.astype(np.float64), made[encoding].magnitude)
        assert y.shape == (m, n)
        assert (np.abs(y - expected) <= bound).all(), (
            f"{encoding}: worst error/bound {(np.abs(y - expected) / bound).max()}"
        )


def test_planar_rows_regroup_each_rows_fields() -> None:
    # Two q4_1 blocks per row: d, m, 16 code bytes each; bytes numbered to follow them.
    row = np.arange(40, dtype=np.uint8)
    planar = BLOCK_ENCODINGS["q4_1"].planar(np.stack([row, row + 100]))
    expected = np.concatenate([row[4:20], row[24:40], row[0:2], row[20:22], row[2:4], row[22:24]])
    np.testing.assert_array_equal(planar, np.stack([expected, expected + 100]))
    row = np.arange(68, dtype=np.uint8)
    expected = np.concatenate([row[2:34], row[36:68], row[0:2], row[34:36]])
    np.testing.assert_array_equal(BLOCK_ENCODINGS["q8_0"].planar(row[None]), expected[None])


def test_gather_rows_dequantize_like_gguf(quant_graph: Model) -> None:
    rows, k = 48, 96
    made = {e: _blocks(e, rows, k, seed=10 + i) for i, e in enumerate(BLOCK_ENCODINGS)}
    ids = np.array([0, 7, 8, 47, 13, 13], np.int64)
    stored = {e: b.planar for e, b in made.items()}
    gathered = _run(quant_graph, np.zeros((1, k), np.float32), stored, ids)[len(BLOCK_ENCODINGS) :]
    for encoding, rows_out in zip(BLOCK_ENCODINGS, gathered, strict=True):
        # One rounding (d * q + m fused) against gguf's two: at most an ulp apart.
        np.testing.assert_allclose(rows_out, made[encoding].exact[ids], rtol=2e-7, atol=1e-7)


def test_gather_rejects_a_token_id_outside_the_table(quant_graph: Model) -> None:
    stored = {e: _blocks(e, 8, 32, seed=0).planar for e in BLOCK_ENCODINGS}
    with pytest.raises(ValueError, match="token id 8 is outside the table's 8 rows"):
        _run(quant_graph, np.zeros((1, 32), np.float32), stored, np.array([8], np.int64))


def test_matmul_rejects_weights_of_another_width(quant_graph: Model) -> None:
    stored = {e: _blocks(e, 8, 64, seed=0).planar for e in BLOCK_ENCODINGS}
    with pytest.raises(ValueError, match="x has 32 columns but the q4_1 weight rows are 40 bytes"):
        _run(quant_graph, np.zeros((2, 32), np.float32), stored, np.zeros(1, np.int64))


def test_formats_reject_shapes_the_kernels_cannot_read() -> None:
    with pytest.raises(ValueError, match="unknown weight encoding 'q5_k'"):
        declare_weight("w", "q5_k", 8, 32, CPU)
    with pytest.raises(ValueError, match="q4_1 rows hold multiples of 32 values, not 40"):
        declare_weight("w", "q4_1", 8, 40, CPU)
