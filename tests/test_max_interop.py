"""MAX's own types in mokv's managers: real `max.pipelines.context.TextContext`s
driven through both managers (side by side with MAX's own manager for the
paged one), and MAX's `KVCacheParams` converted or refused field by field."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from max.driver import CPU
from max.dtype import DType
from max.graph import DeviceRef

pytest.importorskip("max.pipelines.context")

from max.nn import kv_cache as max_kv

from mokv import (
    ContinuousBatchingKVCacheManager,
    KVCacheParams,
    MultiKVCacheParams,
    PagedKVCacheManager,
    TextContext,
    cache_context,
    from_max,
)
from mokv.context import MaxTextContextAdapter
from mokv_reference.manager_backends import MaxBackend

PAGE = 4


def max_context(request_id: str, tokens) -> object:
    return MaxBackend.new_context(None, request_id, np.asarray(tokens, np.int64))  # type: ignore[arg-type]


def test_adapter_reads_what_max_holds() -> None:
    ctx = max_context("a", range(10))
    view = cache_context(ctx)
    assert isinstance(view, MaxTextContextAdapter)
    assert (view.processed_length, view.active_length, view.current_length) == (0, 10, 10)
    ctx.tokens.chunk(6)  # MAX's chunked prefill: the window ends before the last token
    assert (view.active_length, view.current_length) == (6, 6)
    np.testing.assert_array_equal(view.tokens, np.arange(10))
    ours = TextContext("b", [1, 2])
    assert cache_context(ours) is ours
    with pytest.raises(TypeError, match=r"expected a mokv.TextContext or MAX's .* got builtins.dict"):
        cache_context({"request_id": "x"})


def test_paged_manager_drives_max_contexts_as_max_does() -> None:
    """Two requests sharing a prefix through mokv's manager and MAX's own, on
    equal MAX contexts: the same pages, windows and cache bookkeeping."""
    params = KVCacheParams(
        DType.float32, n_kv_heads=1, head_dim=8, num_layers=1, page_size=PAGE, enable_prefix_caching=True
    )
    ours = PagedKVCacheManager(params, None, 16, enable_runtime_checks=True, max_batch_size=4)
    theirs = MaxBackend(PAGE, 16, 4)
    prompt = np.arange(11)
    for request_id in ("a", "b"):
        mine, ref = max_context(request_id, prompt), max_context(request_id, prompt)
        ours.claim(mine.request_id)
        theirs.claim(ref)
        ours.alloc(mine)
        theirs.alloc(ref)
        assert mine.tokens.processed_length == ref.tokens.processed_length
        assert mine.tokens.active_length == ref.tokens.active_length
        assert mine.cached_prefix_length == ref.cached_prefix_length
        assert mine.cached_prefix_external_length == ref.cached_prefix_external_length == 0
        assert ours.get_req_blocks(mine.request_id) == theirs.blocks(ref)
        (device,) = ours.runtime_inputs([[mine]]).inputs
        assert device.cache_lengths.to_numpy().tolist() == [mine.tokens.processed_length]
        for token in (50, 51):
            mine.update(token)
            ref.update(token)
            ours.step([[mine]])
            theirs.step([ref])
            ours.alloc(mine)
            theirs.alloc(ref)
            assert ours.get_req_blocks(mine.request_id) == theirs.blocks(ref)
        ours.release(mine.request_id)
        theirs.release(ref)
    # b found a's first two pages (8 tokens): the window moved as MAX moves it.
    assert mine.cached_prefix_length == 8 and ours.get_metrics_aggregated().cache_tokens == 8
    assert ours.num_free_blocks() == theirs.num_free_blocks() == 16


def test_continuous_manager_drives_max_contexts(session) -> None:
    params = KVCacheParams(DType.float32, n_kv_heads=2, head_dim=8, num_layers=1)
    manager = ContinuousBatchingKVCacheManager(params, 2, 16, 1, [CPU()], session)
    ctx = max_context("a", range(5))
    slot = manager.claim(ctx.request_id)
    manager.alloc(ctx)
    (device,) = manager.runtime_inputs([[ctx]]).inputs
    assert device.cache_lengths.to_numpy().tolist() == [0] and device.is_cache_empty.item() is True
    ctx.update(9)
    manager.step([[ctx]])
    manager.alloc(ctx)
    (device,) = manager.runtime_inputs([[ctx]]).inputs
    assert device.cache_lengths.to_numpy().tolist() == [5] and device.lookup_table.to_numpy().tolist() == [slot]
    assert manager.cache_length(ctx.request_id) == 5
    manager.release(ctx.request_id)
    assert not manager.contains(ctx.request_id) and manager.num_free_slots == 2


def max_params(**overrides) -> max_kv.MHAKVCacheParams:
    base = {
        "dtype": DType.bfloat16,
        "n_kv_heads": 4,
        "head_dim": 16,
        "num_layers": 3,
        "page_size": 16,
        "devices": [DeviceRef.CPU(), DeviceRef.CPU()],
        "enable_prefix_caching": True,
    }
    return max_kv.MHAKVCacheParams(**{**base, **overrides})


def test_max_params_convert_with_every_size_intact() -> None:
    theirs = max_params()
    ours = from_max(theirs)
    assert ours == KVCacheParams(
        DType.bfloat16,
        n_kv_heads=4,
        head_dim=16,
        num_layers=3,
        page_size=16,
        devices=[DeviceRef.CPU(), DeviceRef.CPU()],
        enable_prefix_caching=True,
    )
    assert ours.n_kv_heads_per_device == theirs.n_kv_heads_per_device == 2
    assert ours.bytes_per_page * ours.tensor_parallel_degree == theirs.bytes_per_block
    # The managers take MAX's params directly.
    manager = PagedKVCacheManager(max_params(devices=[DeviceRef.CPU()]), None, 4, max_batch_size=1)
    assert manager.params == from_max(max_params(devices=[DeviceRef.CPU()]))


def test_max_multi_params_convert_to_a_tree() -> None:
    tree = max_kv.MultiKVCacheParams.from_params({"target": max_params(), "draft": max_params(num_layers=1)})
    ours = from_max(tree)
    assert isinstance(ours, MultiKVCacheParams)
    assert list(ours.leaves()) == ["target", "draft"] and ours.leaves()["draft"].num_layers == 1


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("window_size", 64),
        ("kvcache_quant_config", max_kv.KVCacheQuantizationConfig()),
        ("num_draft_tokens", 2),
        ("per_layer_buffers", True),
        ("kv_hash_algo", "sha256"),
        ("slots_per_page", 8),
    ],
)
def test_unsupported_max_fields_are_refused_by_name(field: str, value: object) -> None:
    extra = {"kv_hash_seed": b"\0" * 32} if field == "kv_hash_algo" else {}
    with pytest.raises(ValueError, match=f"MAX's {field}=.* is not supported"):
        from_max(max_params(**{field: value}, **extra))


def test_every_max_field_is_handled() -> None:
    """A MAX field mokv has never seen is refused unless it holds its default;
    this lists the fields of today's MHAKVCacheParams so a MAX upgrade that adds
    one shows up here."""
    names = {f.name for f in dataclasses.fields(max_kv.MHAKVCacheParams)}
    from mokv.params.max_conversion import _CONVERTED, _FROM_MAX, _HARMLESS, _UNSUPPORTED_BECAUSE

    assert names - set(_FROM_MAX) - _HARMLESS - set(_UNSUPPORTED_BECAUSE) == _CONVERTED


def test_mla_params_are_refused() -> None:
    mla = max_kv.MLAKVCacheParams(
        dtype=DType.bfloat16, head_dim=64, num_layers=1, devices=[DeviceRef.CPU()], num_q_heads=8
    )
    with pytest.raises(TypeError, match="got MLAKVCacheParams"):
        from_max(mla)


def test_max_contexts_cache_salt_isolates_their_prefixes() -> None:
    params = KVCacheParams(
        DType.float32, n_kv_heads=1, head_dim=8, num_layers=1, page_size=PAGE, enable_prefix_caching=True
    )
    m = PagedKVCacheManager(params, None, 16, enable_runtime_checks=True, max_batch_size=4)
    cached = []
    for request_id, salt in (("a", "tenant-1"), ("b", "tenant-2"), ("c", "tenant-1")):
        ctx = max_context(request_id, range(11))
        ctx.cache_salt = salt
        m.claim(ctx.request_id)
        m.alloc(ctx)
        cached.append(ctx.cached_prefix_length)
        ctx.update(0)
        m.step([[ctx]])
        m.release(ctx.request_id)
    assert cached == [0, 0, 8]
