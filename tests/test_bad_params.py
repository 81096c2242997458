"""KVCacheParams, KVCacheQuantConfig, MultiKVCacheParams and KVCacheBuffer
refuse bad arguments, naming the bad value (`tests.support.refusals`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from max.driver import CPU, Buffer
from max.dtype import DType

from mokv import (
    KVCacheBuffer,
    KVCacheParams,
    KVCacheQuantConfig,
    MultiKVCacheParams,
)
from tests.support.refusals import BASE, HUGE, INF, NAN, Case, P, cases, raises_naming

Q = KVCacheParams(
    **{**BASE, "dtype": DType.int8}, page_size=4, kvcache_quant_config=KVCacheQuantConfig(tokens_per_scale=2)
)


def params(**kw: Any) -> Callable[[], Any]:
    return lambda: KVCacheParams(**{**BASE, **kw})


PARAMS_CASES = cases(
    ("heads-bool", params(n_kv_heads=True), TypeError, "True"),
    ("heads-float", params(n_kv_heads=2.0), TypeError, "2.0"),
    ("heads-nan", params(n_kv_heads=NAN), TypeError, "nan"),
    ("heads-str", params(n_kv_heads="2"), TypeError, "'2'"),
    ("heads-none", params(n_kv_heads=None), TypeError, "None"),
    ("layers-zero", params(num_layers=0), ValueError, "num_layers must be >= 1, got 0"),
    ("page-negative", params(page_size=-4), ValueError, "-4"),
    ("page-fraction", params(page_size=1.5), TypeError, "1.5"),
    ("dp-inf", params(data_parallel_degree=INF), TypeError, "inf"),
    ("prefix-str", params(enable_prefix_caching="false"), TypeError, "'false'"),
    ("devices-str", params(devices="cpu"), TypeError, "'cpu'"),
    ("devices-entry", params(devices=["cpu"]), TypeError, "devices[0]"),
    ("swap-nan", params(host_kvcache_swap_space_gb=NAN), ValueError, "nan"),
    (
        "swap-inf",
        params(enable_prefix_caching=True, enable_kvcache_swapping_to_host=True, host_kvcache_swap_space_gb=INF),
        ValueError,
        "inf",
    ),
    ("swap-negative", params(host_kvcache_swap_space_gb=-1.0), ValueError, "-1.0"),
    ("swap-str", params(host_kvcache_swap_space_gb="1"), ValueError, "'1'"),
    ("block-shape-negative", lambda: P.block_shape(-1), ValueError, "-1"),
    ("block-shape-zero", lambda: P.block_shape(0), ValueError, "num_pages must be >= 1, got 0"),
    ("block-shape-fraction", lambda: P.block_shape(2.5), TypeError, "2.5"),
    ("block-shape-bool", lambda: P.block_shape(True), TypeError, "True"),
    ("block-shape-tokens-zero", lambda: P.block_shape(2, tokens_per_page=0), ValueError, "tokens_per_page"),
    ("scales-shape-unquantized", lambda: P.scales_shape(2), ValueError, "kvcache_quant_config"),
    ("scales-shape-tokens", lambda: Q.scales_shape(2, tokens_per_page=3), ValueError, "tokens_per_scale=2"),
    ("quant-config-dict", params(kvcache_quant_config={}), TypeError, "kvcache_quant_config"),
    ("quant-fp8-bare", params(dtype=DType.float8_e4m3fn), ValueError, "kvcache_quant_config"),
    ("quant-granularity-str", lambda: KVCacheQuantConfig(quantization_granularity="8"), TypeError, "'8'"),
    ("quant-tokens-bool", lambda: KVCacheQuantConfig(tokens_per_scale=True), TypeError, "True"),
    ("quant-scale-dtype", lambda: KVCacheQuantConfig(scale_dtype=DType.float16), ValueError, "scale_dtype"),
    ("multi-not-mapping", lambda: MultiKVCacheParams([P]), TypeError, "children"),
    ("multi-child", lambda: MultiKVCacheParams({"a": "p"}), TypeError, "'a'"),
)


@pytest.mark.parametrize("case", PARAMS_CASES)
def test_params_refuse(case: Case) -> None:
    raises_naming(case)


# ------------------------------------------------------------------ buffers


def page_tensor() -> Buffer:
    return Buffer.zeros(P.block_shape(3), DType.float32, device=CPU())


BUFFER_CASES = cases(
    ("values-numpy", lambda: KVCacheBuffer(False, [np.zeros((3, 4))]), TypeError, "values[0]"),
    ("values-none", lambda: KVCacheBuffer(False, None), TypeError, "None"),
    ("replicates-str", lambda: KVCacheBuffer("no", [page_tensor()]), TypeError, "'no'"),
    ("null-pages-fraction", lambda: KVCacheBuffer(False, [page_tensor()], num_null_pages=0.5), TypeError, "0.5"),
    ("null-pages-negative", lambda: KVCacheBuffer(False, [page_tensor()], num_null_pages=-1), ValueError, "-1"),
    ("null-pages-all", lambda: KVCacheBuffer(False, [page_tensor()], num_null_pages=3), ValueError, "3"),
    ("allocate-huge", lambda: KVCacheBuffer.allocate(P, HUGE, P.devices), ValueError, f"total_num_pages={HUGE}"),
    ("allocate-zero", lambda: KVCacheBuffer.allocate(P, 0, P.devices), ValueError, "0"),
    ("allocate-fraction", lambda: KVCacheBuffer.allocate(P, 2.5, P.devices), TypeError, "2.5"),
    ("allocate-device", lambda: KVCacheBuffer.allocate(P, 4, ["cpu"]), TypeError, "'cpu'"),
    ("allocate-params", lambda: KVCacheBuffer.allocate("P", 4, P.devices), TypeError, "str"),
    ("allocate-null-str", lambda: KVCacheBuffer.allocate(P, 4, P.devices, null_page="yes"), TypeError, "'yes'"),
)


@pytest.mark.parametrize("case", BUFFER_CASES)
def test_buffers_refuse(case: Case) -> None:
    raises_naming(case)
