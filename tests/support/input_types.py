"""Checks of runtime inputs against the graph input types they are declared with,
and the quantized KV formats those checks run over (the contract tests and the
managers' tests share them)."""

from __future__ import annotations

from max.dtype import DType
from max.graph import BufferType, TensorType

from mokv import KVCacheQuantConfig


def assert_inputs_match_types(buffers: list, types: list[BufferType | TensorType]) -> None:
    """Every buffer has its type's dtype, rank, device kind and static sizes, and
    each symbolic dimension takes one value across all the inputs."""
    assert len(buffers) == len(types)
    symbols: dict[str, int] = {}
    for buffer, t in zip(buffers, types, strict=True):
        assert buffer.dtype == t.dtype, (buffer, t)
        assert buffer.rank == len(t.shape), (buffer, t)
        assert buffer.device.is_host == (t.device.device_type.value == "cpu"), (buffer, t)
        for size, dim in zip(buffer.shape, t.shape, strict=True):
            text = str(dim)
            if text.isdigit():
                assert size == int(text), (buffer, t)
            else:
                assert symbols.setdefault(text, size) == size, f"{text}: {symbols[text]} vs {size}"


QUANTIZATIONS = {
    "bfloat16": (DType.bfloat16, None),
    "float8-per-token": (DType.float8_e4m3fn, KVCacheQuantConfig()),
    "int8-blocks": (DType.int8, KVCacheQuantConfig(quantization_granularity=4, tokens_per_scale=2)),
}
