"""The graph contract: runtime inputs match the declared graph input types on
every device (tensor parallel, data parallel, several caches), and the
records, specs and Mojo-facing order agree."""

from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np
import pytest
from max.dtype import DType
from max.graph import BufferType, DeviceRef, Graph

from mokv import (
    KVCacheInputs,
    KVCacheParams,
    KVCacheQuantConfig,
    MultiKVCacheInputs,
    MultiKVCacheParams,
    PagedKVCacheManager,
    TextContext,
    cache_input_types,
)
from mokv.contract import (
    CONTINUOUS_INPUTS,
    PAGED_INPUTS,
    ContinuousCacheInputs,
    PagedCacheInputs,
    continuous_input_types,
    paged_input_types,
)
from mokv.graph import ContinuousCacheValues, FetchContinuousBatchingKVCacheCollection, PagedCacheValues
from tests.support.input_types import QUANTIZATIONS, assert_inputs_match_types

CPU = DeviceRef.CPU()


def test_records_follow_the_specs() -> None:
    assert [f.name for f in fields(PagedCacheInputs)] == [s.name for s in PAGED_INPUTS]
    assert [f.name for f in fields(ContinuousCacheInputs)] == [s.name for s in CONTINUOUS_INPUTS]


def run_one_request(manager: PagedKVCacheManager, tokens, replica: int = 0) -> TextContext:
    ctx = TextContext(f"r{replica}-{len(tokens)}", np.asarray(tokens, np.int64))
    manager.claim(ctx.request_id, replica)
    manager.alloc(ctx, replica)
    return ctx


@pytest.mark.parametrize("quantization", QUANTIZATIONS)
@pytest.mark.parametrize(("devices", "dp"), [(2, 1), (4, 2)])
def test_tensor_parallel_inputs_match_declared_types(devices: int, dp: int, quantization: str) -> None:
    """Every device's runtime inputs have the declared types, with the page
    size symbolic and fixed; a quantized cache's scales come last, as that
    shard's scales tensor."""
    dtype, config = QUANTIZATIONS[quantization]
    params = KVCacheParams(
        dtype,
        n_kv_heads=4,
        head_dim=8,
        num_layers=2,
        page_size=4,
        devices=[CPU] * devices,
        data_parallel_degree=dp,
        kvcache_quant_config=config,
    )
    manager = PagedKVCacheManager(params, None, 8, max_batch_size=2)
    batches = [[run_one_request(manager, range(6 + r), r)] for r in range(dp)]
    inputs = manager.runtime_inputs(batches)
    for types in (cache_input_types(params), cache_input_types(params, params.page_size)):
        assert len(inputs.inputs) == len(types.inputs) == devices
        for device_inputs, device_types in zip(inputs.inputs, types.inputs, strict=True):
            assert device_inputs.blocks.shape[4] == params.n_kv_heads_per_device == 4 // (devices // dp)
            assert_inputs_match_types(device_inputs.flatten(), device_types.flatten())
    shards = [s for r in range(dp) for s in zip(*_buffers_of(manager.get_device_buffer(r)), strict=True)]
    for device_inputs, (blocks, scales) in zip(inputs.inputs, shards, strict=True):
        assert device_inputs.blocks is blocks and device_inputs.scales is scales
        expected = [blocks, device_inputs.cache_lengths, device_inputs.lookup_table, device_inputs.max_lengths]
        assert device_inputs.flatten() == expected + ([] if scales is None else [scales])


def _buffers_of(buffer) -> tuple[list, list]:
    """Each shard's (blocks as graphs take them, scales), scales None when unquantized."""
    return buffer.graph_values, buffer.scales or [None] * len(buffer.values)


def test_quantized_input_types_follow_the_quant_config() -> None:
    """The scales input: a mutable float32 buffer on the cache's device, paged
    like the blocks, page_size // tokens_per_scale rows of head_dim //
    granularity scales (symbolic rows when the page size is)."""
    params = KVCacheParams(
        DType.float8_e4m3fn,
        n_kv_heads=2,
        head_dim=16,
        num_layers=3,
        page_size=8,
        kvcache_quant_config=KVCacheQuantConfig(quantization_granularity=4, tokens_per_scale=2),
    )
    fixed = paged_input_types(params, 8).scales
    assert isinstance(fixed, BufferType) and fixed.dtype == DType.float32 and fixed.device == CPU
    assert [str(d) for d in fixed.shape] == ["num_physical_pages", "2", "3", "4", "2", "4"]
    symbolic = paged_input_types(params).scales
    assert [str(d) for d in symbolic.shape] == ["num_physical_pages", "2", "3", "scale_rows", "2", "4"]
    continuous = continuous_input_types(params, 32).scales
    assert [str(d) for d in continuous.shape] == ["num_slots", "2", "3", "16", "2", "4"]
    with pytest.raises(ValueError, match="tokens_per_scale=2 must divide the 7 tokens of a page"):
        continuous_input_types(params, 7)
    unquantized = paged_input_types(KVCacheParams(DType.float32, 2, 16, 3))
    assert unquantized.scales is None and len(unquantized.flatten()) == 4


@pytest.mark.parametrize(("granularity", "cols"), [(None, "1"), (8, "scale_cols")])
def test_a_symbolic_head_dim_leaves_scale_cols_symbolic_unless_one_scale_spans_the_head(
    granularity: int | None, cols: str
) -> None:
    @dataclass
    class SymbolicShape:
        """A graph's cache shape with the head count and head size left symbolic."""

        kvcache_quant_config: KVCacheQuantConfig
        dtype: DType = DType.int8
        num_layers: int = 2
        n_kv_heads_per_device: int | str = "n_kv_heads"
        head_dim: int | str = "head_dim"

    scales = paged_input_types(SymbolicShape(KVCacheQuantConfig(quantization_granularity=granularity))).scales
    assert [str(d) for d in scales.shape] == ["num_physical_pages", "2", "2", "scale_rows", "n_kv_heads", cols]


def test_several_caches_share_one_page_table() -> None:
    """A target and a (quantized) draft cache of different shapes and dtypes:
    one claim, one allocation and one prefix hit serve both; the inputs form a
    tree in the declared order; a host-tier round trip restores both caches'
    bytes, the draft's scales included."""
    common = {"page_size": 4, "enable_prefix_caching": True}
    params = MultiKVCacheParams(
        {
            "target": KVCacheParams(DType.float32, n_kv_heads=2, head_dim=8, num_layers=2, **common),
            "draft": KVCacheParams(
                DType.int8, n_kv_heads=1, head_dim=16, num_layers=1, kvcache_quant_config=KVCacheQuantConfig(), **common
            ),
        }
    )
    manager = PagedKVCacheManager(params, None, 6, total_num_host_pages=4, enable_runtime_checks=True, max_batch_size=2)
    buffers = manager.get_device_buffer(0)
    assert set(buffers) == {"target", "draft"}
    a = run_one_request(manager, range(9))  # 3 pages
    pages = manager.get_req_blocks(a.request_id)
    marks = {(name, i): unit.buffer.to_numpy() for name in buffers for i, unit in enumerate(buffers[name].to_memory())}
    assert list(marks) == [("target", 0), ("draft", 0), ("draft", 1)]  # the draft's values, then its scales
    for (name, i), raw in marks.items():
        raw[pages] = np.random.default_rng([len(name), i]).integers(1, 255, raw[pages].shape, dtype=np.uint8)
    saved = {name: raw[pages].copy() for name, raw in marks.items()}

    inputs = manager.runtime_inputs([[a]])
    assert isinstance(inputs, MultiKVCacheInputs) and list(inputs.children) == ["target", "draft"]
    target, draft = (inputs.children[n].inputs[0] for n in ("target", "draft"))
    assert target.blocks is buffers["target"].graph_values[0] and draft.blocks is buffers["draft"].graph_values[0]
    assert target.scales is None and draft.scales is buffers["draft"].scales[0]
    np.testing.assert_array_equal(target.lookup_table.to_numpy(), draft.lookup_table.to_numpy())
    assert inputs.flatten() == [*target.flatten(), *draft.flatten()]
    assert_inputs_match_types(inputs.flatten(), cache_input_types(params).flatten())
    with pytest.raises(AssertionError, match="needs a single cache, but this manager serves 2"):
        manager.runtime_inputs_for_leaf([[a]])

    a.update(1)
    manager.step([[a]])
    manager.release(a.request_id)
    # Another prompt evicts a's two committed pages to the host tier...
    run_one_request(manager, range(100, 121))
    manager.release("r0-21")
    for raw in marks.values():
        raw[:] = 0
    # ...and a request with a's prefix gets them back into both caches at once.
    b = run_one_request(manager, range(9))
    assert b.processed_length == 8 and manager.get_metrics_aggregated().h2d_blocks_copied == 2
    restored = manager.get_req_blocks(b.request_id)[:2]
    for name, raw in marks.items():
        np.testing.assert_array_equal(raw[restored], saved[name][:2])


def test_multi_cache_children_must_agree_on_the_page_table() -> None:
    a = KVCacheParams(DType.float32, 1, 8, 1, page_size=4)
    with pytest.raises(ValueError, match="child caches must share page_size: 'a' has 4, 'b' has 8"):
        MultiKVCacheParams({"a": a, "b": KVCacheParams(DType.float32, 1, 8, 1, page_size=8)})
    with pytest.raises(ValueError, match="needs at least one child"):
        MultiKVCacheParams({})
    nested = MultiKVCacheParams({"t": MultiKVCacheParams({"x": a, "y": a}), "d": a})
    assert list(nested.leaves()) == ["t.x", "t.y", "d"]
    tree = cache_input_types(nested)
    assert isinstance(tree.children["t"], MultiKVCacheInputs) and isinstance(tree.children["d"], KVCacheInputs)
    assert len(tree.flatten()) == 3 * len([s for s in PAGED_INPUTS if not s.quantized_only])


@pytest.mark.parametrize("layout", ["paged", "continuous"])
def test_graph_values_hold_the_scales_and_pass_them_after_the_blocks(layout: str) -> None:
    """Inside a graph (built, not compiled): a quantized cache's values carry
    the scales buffer, and the ops' operands are blocks, scales, lengths, table."""
    quantized = KVCacheParams(
        DType.float8_e4m3fn, n_kv_heads=2, head_dim=16, num_layers=3, kvcache_quant_config=KVCacheQuantConfig()
    )
    plain = KVCacheParams(DType.bfloat16, n_kv_heads=2, head_dim=16, num_layers=3)
    input_types = paged_input_types if layout == "paged" else continuous_input_types
    values_type = PagedCacheValues if layout == "paged" else ContinuousCacheValues
    with Graph(f"cache_values_{layout}", input_types=[*input_types(quantized), *input_types(plain)]) as graph:
        inputs = graph.inputs
        cache = values_type.from_inputs(inputs[:5])
        assert cache.quantized and cache.scales is not None
        assert cache.scales.dtype == DType.float32 and cache.device == CPU
        assert cache.scales.type == inputs[4].type and cache.blocks.type == inputs[0].type
        expected = [cache.blocks, cache.scales, cache.cache_lengths, cache.lookup_table]
        assert all(a is b for a, b in zip(cache.operands(), expected, strict=True))
        unquantized = values_type.from_inputs(inputs[5:])
        assert not unquantized.quantized and unquantized.scales is None and len(unquantized.operands()) == 3
        with pytest.raises(ValueError, match="needs 4 graph values \\(5 for a quantized cache\\), got 3"):
            values_type.from_inputs(inputs[:3])
        graph.output()


def test_the_opaque_continuous_collection_refuses_a_quantized_cache() -> None:
    params = KVCacheParams(
        DType.int8,
        n_kv_heads=2,
        head_dim=16,
        num_layers=3,
        cache_strategy="continuous",
        kvcache_quant_config=KVCacheQuantConfig(),
    )
    with pytest.raises(ValueError, match="does not support quantized caches yet \\(kvcache_quant_config="):
        FetchContinuousBatchingKVCacheCollection(params)
