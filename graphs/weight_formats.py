"""How the Llama graph holds its weights and multiplies by them, per weight format.

A *weight format* decides what every matrix of a checkpoint looks like inside the graph:

``gguf`` (the default)
    the GGUF's own blocks, byte for byte: SmolLM2's layer matrices are Q4_1 (32 values in 20
    bytes: a float16 scale ``d`` and minimum ``m``, 16 bytes of 4-bit ``q``, value ``d*q + m``)
    and its embedding, which is also the LM head, is Q8_0 (32 values in 34 bytes: a float16
    scale ``d`` and 32 int8 ``q``, value ``d*q``). Each row's bytes are laid out planar
    (:meth:`BlockEncoding.planar`). mokv's own kernels (``mojo/mokv_weights``) dequantize the
    blocks in registers, so a step reads ~96 MB of weights instead of 540 MB. The arithmetic
    is float32 throughout, on exactly the values the ``f32`` format holds, so the two formats
    differ only in the order and grouping of the sums.
``f32``
    every matrix dequantized to float32 once, multiplied by MAX's own matmul: the reference.

Why these two and not MAX's quantized matmul or bfloat16 (measured on the real shapes, see
``mokv bench weights``): MAX 26.7's ``qmatmul`` reads neither Q4_1 nor Q8_0, so using
it means requantizing the checkpoint to Q4_0 (a second rounding of every weight) and it was
slower than mokv's kernel; MAX's bfloat16 matmul on this AVX2 CPU was slower than float32.

Each matrix is a graph :class:`~max.graph.Weight` named as in the GGUF; an ``encoding``
(``"f32"``, ``"q4_1"``, ``"q8_0"``) tells :func:`linear` and :func:`embedding` which kernel
reads it. Block matrices are ``uint8`` arrays ``[rows, blocks_per_row * block_bytes]``: the
GGUF's own bytes, each row planar.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
from max.dtype import DType
from max.graph import DeviceRef, TensorType, TensorValue, Weight, ops

from mokv.kernels import kernel_package

WEIGHT_FORMATS = ("gguf", "f32")
"""Every weight format a checkpoint can be loaded in; the first is the default."""


@dataclass(frozen=True)
class BlockEncoding:
    """A GGUF block encoding: ``values`` weights stored in ``nbytes`` bytes, the first
    ``2 * scales`` of them float16 fields (``d``, and ``m`` for Q4_1), then the codes."""

    name: str
    values: int
    nbytes: int
    scales: int

    def planar(self, blocks: np.ndarray) -> np.ndarray:
        """GGUF rows of blocks ``[rows, blocks_per_row * nbytes]`` with each row's bytes
        regrouped: every block's codes, then every ``d``, then (Q4_1) every ``m``.

        The same bytes and row size; the kernels convert sixteen scales of a row with one
        instruction where interleaved blocks cost a conversion and shuffles per block
        (``mojo/mokv_weights/blocks.mojo``)."""
        rows = blocks.shape[0]
        per_block = np.asarray(blocks, np.uint8).reshape(rows, -1, self.nbytes)
        fields = [per_block[:, :, 2 * self.scales :]]
        fields += [per_block[:, :, 2 * i : 2 * i + 2] for i in range(self.scales)]
        return np.concatenate([f.reshape(rows, -1) for f in fields], axis=1)

    def row_bytes(self, columns: int) -> int:
        """Bytes of one stored row of ``columns`` weights."""
        if columns % self.values:
            raise ValueError(f"{self.name} rows hold multiples of {self.values} values, not {columns}")
        return columns // self.values * self.nbytes


BLOCK_ENCODINGS = {e.name: e for e in (BlockEncoding("q4_1", 32, 20, 2), BlockEncoding("q8_0", 32, 34, 1))}
"""The block encodings mokv's kernels read, by the name the kernels know them by."""


QUANT_KERNELS = "mokv_weights"
"""The Mojo package of the block-format weight kernels (shipped beside `mokv_kernels`)."""


def quant_kernel_package() -> Path:
    """The precompiled ``mokv_weights`` package, built once per source revision."""
    return kernel_package(QUANT_KERNELS)


def uses_quant_kernels(encodings: dict[str, str]) -> bool:
    """Whether a graph over weights of these encodings needs ``mokv_weights``."""
    return any(e in BLOCK_ENCODINGS for e in encodings.values())


def declare_weight(name: str, encoding: str, rows: int, columns: int, device: DeviceRef) -> Weight:
    """The graph weight ``name``: ``[rows, columns]`` float32, or its rows of blocks."""
    if encoding == "f32":
        return Weight(name, DType.float32, [rows, columns], device)
    block = _block_encoding(encoding)
    return Weight(name, DType.uint8, [rows, block.row_bytes(columns)], device)


def linear(x: TensorValue, weight: Weight, encoding: str) -> TensorValue:
    """``x @ w.T`` for ``x`` ``[tokens, in]`` and a ``[out, in]`` weight (GGUF/PyTorch layout)."""
    if encoding == "f32":
        return ops.matmul(x, ops.transpose(weight, 0, 1))
    _block_encoding(encoding)
    out_type = TensorType(DType.float32, [x.shape[0], weight.shape[0]], x.device)
    return ops.custom("mokv_quant.matmul", x.device, [x, weight], [out_type], parameters={"encoding": encoding})[
        0
    ].tensor


def embedding(table: Weight, ids: TensorValue, encoding: str, columns: int) -> TensorValue:
    """Rows ``ids`` of an embedding table, as float32 ``[len(ids), columns]``."""
    if encoding == "f32":
        return ops.gather(table, ids, axis=0)
    _block_encoding(encoding)
    out_type = TensorType(DType.float32, [ids.shape[0], columns], ids.device)
    return ops.custom(
        "mokv_quant.gather_rows", ids.device, [table, ids], [out_type], parameters={"encoding": encoding}
    )[0].tensor


def _block_encoding(encoding: str) -> BlockEncoding:
    try:
        return BLOCK_ENCODINGS[encoding]
    except KeyError:
        known = ", ".join(["f32", *BLOCK_ENCODINGS])
        raise ValueError(f"unknown weight encoding {encoding!r}; known: {known}") from None
