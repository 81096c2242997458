"""mokv's cache options read from MAX's own cache flags (`KVCacheConfig`, as
`max serve` / `max generate` parse them): what each setting becomes, and what
is refused by name."""

from __future__ import annotations

import pytest
from max.dtype import DType
from max.graph import DeviceRef
from max.nn.kv_cache import KVCacheQuantizationConfig, MHAKVCacheParams
from max.pipelines.kv_cache import KVCacheConfig, KVConnectorConfig

from mokv.pipelines.cache_config import HOST_POOL_FACTOR, mokv_cache_config

MODEL = "/models/smollm2"


def _params(**changes) -> MHAKVCacheParams:
    base = {
        "dtype": DType.float32,
        "n_kv_heads": 3,
        "head_dim": 64,
        "num_layers": 30,
        "page_size": 16,
        "devices": [DeviceRef.CPU()],
        "enable_prefix_caching": True,
    }
    return MHAKVCacheParams(**{**base, **changes})


def _flags(connector: dict | None = None) -> KVCacheConfig:
    if connector is None:
        return KVCacheConfig()
    return KVCacheConfig(kv_connector_config=KVConnectorConfig.model_validate(connector))


def test_default_flags_give_mokvs_params_and_no_tiers() -> None:
    cache = mokv_cache_config(_params(), _flags(), MODEL)
    assert (cache.params.page_size, cache.params.dtype, cache.params.enable_prefix_caching) == (16, DType.float32, True)
    assert cache.connector is None and cache.total_num_host_pages(100) == 0


def test_float8_cache_keeps_its_scale_config() -> None:
    scales = KVCacheQuantizationConfig(scale_dtype=DType.float32, quantization_granularity=64)
    cache = mokv_cache_config(_params(dtype=DType.float8_e4m3fn, kvcache_quant_config=scales), _flags(), MODEL)
    assert cache.params.quantized and cache.params.kvcache_quant_config.tokens_per_scale == 1


def test_rust_tiered_selects_mokvs_tiers_from_maxs_fields_and_extras(tmp_path) -> None:
    flags = _flags(
        {
            "type": "rust_tiered",
            "host_offload_max_gb": 0.25,
            "disk_offload_dir": str(tmp_path),
            "disk_offload_max_gb": 2,
            "num_disk_workers": 2,
            "remote_url": "redis://user:secret@127.0.0.1:6390/0",
            "remote_ttl_s": 60,
        }
    )
    cache = mokv_cache_config(_params(), flags, MODEL)
    assert cache.total_num_host_pages(100) == int(0.25 * (1 << 30)) // cache.params.bytes_per_page
    tiers = cache.connector
    assert (tiers.model_id, tiers.disk_offload_dir, tiers.disk_offload_max_gb) == (MODEL, str(tmp_path), 2)
    assert (tiers.io_threads, tiers.remote_ttl_s, tiers.remote_where) == (2, 60, "redis://127.0.0.1:6390/0")


def test_rust_tiered_alone_is_a_host_tier_sized_as_max_sizes_it() -> None:
    cache = mokv_cache_config(_params(), _flags({"type": "rust_tiered"}), MODEL)
    assert cache.connector is None and cache.total_num_host_pages(100) == int(HOST_POOL_FACTOR * 100)
    dropped = _flags({"type": "tiered", "disk_offload_dir": "/x", "disk_offload_max_gb": 0})
    no_disk = mokv_cache_config(_params(), dropped, MODEL)
    assert no_disk.connector is None  # MAX's 0 drops the disk tier


@pytest.mark.parametrize(
    ("connector", "message"),
    [
        ({"type": "null", "disk_offload_dir": "/tmp"}, r"sets disk_offload_dir with type 'null'"),
        ({"type": "rust_tiered", "colour": "red"}, r"fields mokv does not know: colour"),
        ({"type": "dkv", "block_store_endpoint": "ipc:///kv"}, r"type='dkv': mokv's tiers are selected by"),
        ({"type": "rust_tiered", "remote_ttl_s": "soon"}, r"remote_ttl_s='soon' must be a float"),
        ({"type": "rust_tiered", "remote_url": "http://cache"}, r"remote_url must be a redis:// or rediss:// URL"),
    ],
)
def test_settings_mokv_cannot_honour_are_refused_by_name(connector: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        mokv_cache_config(_params(), _flags(connector), MODEL)


def test_params_mokv_refuses_are_refused_by_name() -> None:
    with pytest.raises(ValueError, match=r"MAX's per_layer_buffers=True is not supported"):
        mokv_cache_config(_params(per_layer_buffers=True), _flags(), MODEL)
