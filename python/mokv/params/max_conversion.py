"""MAX's own cache parameters converted to mokv's (`from_max`), refusing what
mokv does not support, and `resolve_params`, which the managers call first."""

from __future__ import annotations

import dataclasses
from typing import Any

from max.dtype import DType

from .cache_params import KVCacheParams
from .multi import AnyKVCacheParams, MultiKVCacheParams
from .quantization import QUANTIZED_DTYPES, KVCacheQuantConfig

_FROM_MAX = ("dtype", "head_dim", "num_layers", "devices", "page_size", "data_parallel_degree", "n_kv_heads")
"""Fields of MAX's `MHAKVCacheParams` that become mokv fields of the same name."""

_UNSUPPORTED_BECAUSE = {
    "per_layer_buffers": "mokv keeps all layers in one page tensor per device",
    "kv_hash_algo": "mokv hashes pages with its own verified chained hash",
    "kv_hash_seed": "mokv hashes pages with its own verified chained hash",
    "kv_connector_config": "mokv's host tier is configured by total_num_host_pages",
    "slots_per_page": "mokv stores one slot per token",
    "speculative_method": "mokv reserves no speculative-decoding slack",
    "num_draft_tokens": "mokv reserves no speculative-decoding slack",
    "window_size": "mokv caches keep every token; pass the window to mokv.graph.attention",
    "allow_kv_head_replication": "mokv splits KV heads evenly across TP devices",
}
"""Why each MAX field that mokv cannot honour is refused when set away from its default."""

_CONVERTED = frozenset({"enable_prefix_caching", "kvcache_quant_config"})
"""MAX fields `from_max` carries over (the quant config converted to mokv's type)."""

_HARMLESS = frozenset({"enable_dp_cross_replica_prefix_copy"})
"""MAX fields that only permit something mokv never does, so any value is honoured."""


def _max_field_is_default(params: Any, f: dataclasses.Field) -> bool:
    value = getattr(params, f.name)
    if f.name == "slots_per_page":  # MAX resolves None to page_size at construction
        return value in (None, params.page_size)
    if f.name == "kv_connector_config":
        return str(getattr(value.type, "value", value.type)) == "null"
    if f.name == "allow_kv_head_replication":  # only matters when heads do not divide evenly
        return not value or params.n_kv_heads % params.tensor_parallel_degree == 0
    if f.default is not dataclasses.MISSING:
        return value == f.default
    if f.default_factory is not dataclasses.MISSING:
        return value == f.default_factory()
    return False


def _quant_config_from_max(config: Any, dtype: DType) -> KVCacheQuantConfig | None:
    """MAX's `KVCacheQuantizationConfig` on a `dtype` cache as mokv's: the
    scale dtype and the granularity carry over 1:1, each token gets its own
    scales.

    Raises:
        ValueError: A setting mokv does not support (a scale dtype other than
            float32, a config on a dtype mokv does not quantize, which MAX
            would ignore); the message names it.
    """
    if config is None:
        return None
    refused = f"MAX's kvcache_quant_config={config!r} is not supported"
    if dtype not in QUANTIZED_DTYPES:
        supported = " and ".join(d.name for d in QUANTIZED_DTYPES)
        raise ValueError(f"{refused} on dtype={dtype.name}: mokv quantizes {supported} caches")
    try:
        return KVCacheQuantConfig(
            scale_dtype=config.scale_dtype, quantization_granularity=config.quantization_granularity
        )
    except (TypeError, ValueError) as error:
        raise ValueError(f"{refused}: {error}") from None


def from_max(params: Any) -> AnyKVCacheParams:
    """Converts MAX's own cache parameters to mokv's.

    Accepts `max.nn.kv_cache.MHAKVCacheParams` (a leaf) and
    `max.nn.kv_cache.MultiKVCacheParams` (a tree of them). Every field MAX sets
    is either carried over (`dtype`, `head_dim`, `num_layers`, `n_kv_heads`,
    `page_size`, `devices`, `data_parallel_degree`, `enable_prefix_caching`,
    `kvcache_quant_config`), known to be harmless, or must hold its default.

    Raises:
        ValueError: A field mokv does not support is set, or a quantization
            setting it does not support (a scale dtype other than float32, a
            quant config on an unquantized dtype, an 8-bit dtype other than
            float8_e4m3fn / int8); the message names it.
        TypeError: `params` is no MAX parameter type mokv knows (MLA caches,
            recurrent state).
    """
    from max.nn import kv_cache as max_kv

    if isinstance(params, max_kv.MultiKVCacheParams):
        return MultiKVCacheParams({name: from_max(child) for name, child in params.children.items()})
    if not isinstance(params, max_kv.MHAKVCacheParams) or isinstance(params, max_kv.MLAKVCacheParams):
        raise TypeError(f"mokv converts MAX's MHAKVCacheParams and MultiKVCacheParams, got {type(params).__name__}")
    for f in dataclasses.fields(params):
        if f.name in _FROM_MAX or f.name in _CONVERTED or f.name in _HARMLESS:
            continue
        if not _max_field_is_default(params, f):
            reason = _UNSUPPORTED_BECAUSE.get(f.name, "mokv does not implement it")
            raise ValueError(f"MAX's {f.name}={getattr(params, f.name)!r} is not supported: {reason}")
    return KVCacheParams(
        **{name: getattr(params, name) for name in _FROM_MAX},
        enable_prefix_caching=params.enable_prefix_caching,
        kvcache_quant_config=_quant_config_from_max(params.kvcache_quant_config, params.dtype),
    )


def resolve_params(params: object) -> AnyKVCacheParams:
    """mokv params as they are; MAX's own params through `from_max`.

    Raises:
        TypeError: `params` is neither (the message names its type).
    """
    if isinstance(params, (KVCacheParams, MultiKVCacheParams)):
        return params
    if type(params).__module__.startswith("max."):
        return from_max(params)
    raise TypeError(
        f"params must be a mokv KVCacheParams / MultiKVCacheParams or MAX's MHAKVCacheParams / "
        f"MultiKVCacheParams, got {type(params).__module__}.{type(params).__qualname__}"
    )
