"""MAX's cache values mapped onto mokv's while a graph is built (no compile):
what passes through, what is refused by name. The run-time checks (a
non-packed `page_stride`) are exercised on MAX's own buffers in
`test_attention_module.py`."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
from max.dtype import DType
from max.graph import BufferType, DeviceRef, Graph
from max.nn.kv_cache import KVCacheQuantizationConfig, MHAKVCacheParams
from max.pipelines.architectures.llama3 import Llama3Config
from max.pipelines.kv_cache import KVCacheConfig

from mokv.graph import PagedCacheValues
from mokv.pipelines.architecture import MokvLlama3Config
from mokv.pipelines.cache_values import mokv_cache_values

CPU = DeviceRef.CPU()


def _params(**changes) -> MHAKVCacheParams:
    base = {
        "dtype": DType.float32,
        "n_kv_heads": 3,
        "head_dim": 64,
        "num_layers": 2,
        "page_size": 16,
        "devices": [CPU],
    }
    return MHAKVCacheParams(**{**base, **changes})


def _map(params: MHAKVCacheParams, retype=None):
    """`mokv_cache_values` of `params`' symbolic inputs inside a graph
    (`retype` may change each input type first)."""
    types = [retype(t) if retype else t for t in params.flattened_kv_inputs()]
    with Graph("map", input_types=types) as graph:
        (values,) = params.unflatten_kv_inputs(iter(graph.inputs))
        return values, mokv_cache_values(values)


def test_component_tensors_pass_through_and_max_lengths_pair_up() -> None:
    theirs, ours = _map(_params())
    assert isinstance(ours, PagedCacheValues) and not ours.quantized
    assert ours.blocks is theirs.kv_blocks and ours.lookup_table is theirs.lookup_table
    assert list(ours.max_lengths.shape) == [1, 2] and ours.max_lengths.device == CPU
    assert ours.cache_lengths.dtype == DType.uint32 and ours.cache_lengths.shape == theirs.cache_lengths.shape


def test_float8_cache_maps_to_mokvs_quantized_cache_when_its_blocks_are_bits() -> None:
    scales = KVCacheQuantizationConfig(scale_dtype=DType.float32, quantization_granularity=64)
    params = _params(dtype=DType.float8_e4m3fn, kvcache_quant_config=scales)

    def as_bits(t):
        return BufferType(DType.uint8, t.shape, t.device) if t.dtype == DType.float8_e4m3fn else t

    theirs, ours = _map(params, as_bits)
    assert ours.quantized and ours.scales is theirs.kv_scales
    assert list(ours.scales.shape)[3:] == [16, 3, 1]  # one scale per token and KV head
    with pytest.raises(ValueError, match=r"declare float8 blocks as uint8"):
        _map(params)


def test_scales_mokv_cannot_read_are_refused_by_name() -> None:
    int8 = KVCacheQuantizationConfig(scale_dtype=DType.float16, quantization_granularity=64)
    with pytest.raises(ValueError, match=r"kv_scales are float16: mokv's kernels read float32 scales only"):
        _map(_params(dtype=DType.int8, kvcache_quant_config=int8))


def test_per_layer_buffers_are_refused_by_name() -> None:
    with pytest.raises(ValueError, match=r"kv_blocks_per_layer is set \(MAX's per_layer_buffers\)"):
        _map(_params(per_layer_buffers=True))


@pytest.mark.parametrize("dtype", [DType.float8_e4m3fn, DType.float32])
def test_architecture_gives_a_float8_cache_its_scales(dtype: DType) -> None:
    """MAX's Llama builds a float8 cache without a scale config (which MAX's
    kernels then refuse); mokv's config adds one float32 scale per token and KV
    head, and leaves other caches as MAX builds them."""
    hf = SimpleNamespace(num_key_value_heads=3, head_dim=64, num_hidden_layers=2)
    pipeline = SimpleNamespace(model=SimpleNamespace(data_parallel_degree=1), speculative=None)
    args = (hf, pipeline, [CPU], KVCacheConfig(kv_cache_page_size=16), dtype)
    theirs, ours = Llama3Config.construct_kv_params(*args), MokvLlama3Config.construct_kv_params(*args)
    if dtype == DType.float8_e4m3fn:
        assert theirs.kvcache_quant_config is None and ours.quantized_kv_cache
        assert ours.kvcache_quant_config == KVCacheQuantizationConfig(DType.float32, 64)
        assert dataclasses.replace(ours, kvcache_quant_config=None) == theirs
    else:
        assert ours == theirs
