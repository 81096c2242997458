"""mokv's cache options, read from the flags MAX users already configure the cache with.

`max generate` / `max serve` with `--custom-architectures mokv.pipelines.architecture`
take the cache settings of MAX's `KVCacheConfig` (`pipeline_config.model.kv_cache`):

- `--kv-cache-page-size N`: tokens per page. MAX's own manager needs a
  multiple of 128; mokv's takes any page size.
- `--enable-prefix-caching` / `--no-enable-prefix-caching` (on by default).
- `--kv-cache-format float32 | bfloat16 | float8_e4m3fn`: the stored dtype;
  float8 is quantized with one float32 scale per token and KV head (the
  architecture adds the scale config MAX's Llama leaves out).
- `--kv-connector-config JSON`: mokv's tiers below the device pool. `{"type":
  "null"}` (MAX's default) is none. `"tiered"` / `"rust_tiered"`, MAX's
  host-and-disk connector, selects mokv's tiers with MAX's own fields:
  `host_offload_max_gb` (the host tier; unset: 1.5 times the device pool, as
  MAX sizes it; 0: none), `disk_offload_dir` and `disk_offload_max_gb` (the disk
  tier, only where a directory is given; MAX's 0 drops it), `num_disk_workers`
  (mokv's tier I/O threads, when set). A Redis tier and the shared tiers'
  integrity key ride along as extra fields, which MAX's config passes through:
  `remote_url`, `remote_ttl_s`, `remote_timeout_s`, `remote_retry_s`,
  `remote_cluster`, `integrity_key_file`. Fields mokv does not know are
  refused by name.

The cache salt is MAX's own: `max serve --use-client-cache-salt` honours a
request's `cache_salt` (header or body) and puts it on the request's context.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from max.nn.kv_cache import KVConnectorType
from max.nn.kv_cache.cache_params import NullKVConnectorConfig

from ..params import KVCacheParams, from_max
from ..tiers import KVConnectorConfig

_GIB = 1 << 30

HOST_POOL_FACTOR = 1.5
"""The host tier's size in device pools when `host_offload_max_gb` is unset (MAX's default)."""

_TIERED = frozenset({KVConnectorType.tiered, KVConnectorType.rust_tiered})

_REMOTE_FIELDS = {
    "remote_url": str,
    "remote_ttl_s": float,
    "remote_timeout_s": float,
    "remote_retry_s": float,
    "remote_cluster": bool,
    "integrity_key_file": str,
}
"""The extra `--kv-connector-config` fields mokv reads, and their types."""

_IGNORED_ON_CPU = frozenset({"host_staging_alloc", "host_staging_mlock", "num_h2d_onload_lanes", "use_disk_direct_io"})
"""MAX's connector fields about pinned GPU staging and O_DIRECT, which mokv's tiers never use."""


@dataclass(frozen=True)
class MokvCacheConfig:
    """What mokv's manager is built from inside MAX's pipeline.

    Attributes:
        params: MAX's cache params converted (`mokv.params.from_max`), with
            MAX's connector taken off: mokv's tiers are the fields below.
        host_offload_max_gb: The host tier's budget; None sizes it as MAX does
            (`HOST_POOL_FACTOR` device pools), 0 means no host tier. Only read
            when `tiered`.
        connector: The disk and remote tiers (None: neither).
        tiered: Whether `--kv-connector-config` asked for tiers at all.
    """

    params: KVCacheParams
    host_offload_max_gb: float | None = None
    connector: KVConnectorConfig | None = None
    tiered: bool = False

    def total_num_host_pages(self, total_num_pages: int) -> int:
        """Host pages for a device pool of `total_num_pages` (0 when there is no host tier)."""
        if not self.tiered:
            return 0
        if self.host_offload_max_gb is None:
            return math.ceil(HOST_POOL_FACTOR * total_num_pages)
        return int(self.host_offload_max_gb * _GIB) // self.params.bytes_per_page


def _connector(settings: Any, model_id: str) -> tuple[float | None, KVConnectorConfig | None]:
    """The host budget and the disk / remote tiers of MAX's connector settings."""
    extra = dict(settings.model_extra or {})
    unknown = sorted(set(extra) - set(_REMOTE_FIELDS))
    if unknown:
        raise ValueError(
            f"--kv-connector-config has fields mokv does not know: {', '.join(unknown)} "
            f"(mokv reads MAX's host/disk fields and {', '.join(_REMOTE_FIELDS)})"
        )
    remote: dict[str, Any] = {}
    for name, kind in _REMOTE_FIELDS.items():
        if name in extra:
            value = extra[name]
            if not isinstance(value, kind) and not (kind is float and isinstance(value, int)):
                raise ValueError(f"--kv-connector-config {name}={value!r} must be a {kind.__name__}")
            remote[name] = value
    disk_dir = settings.disk_offload_dir
    if settings.disk_offload_max_gb == 0:  # MAX's spelling of "no disk tier"
        disk_dir = None
    io = {"io_threads": settings.num_disk_workers} if "num_disk_workers" in settings.model_fields_set else {}
    tiers = KVConnectorConfig(
        model_id=model_id,
        disk_offload_dir=disk_dir,
        disk_offload_max_gb=settings.disk_offload_max_gb if disk_dir is not None else None,
        **remote,
        **io,
    )
    return settings.host_offload_max_gb, tiers if tiers.enabled else None


def mokv_cache_config(params: Any, kv_cache: Any, model_id: str) -> MokvCacheConfig:
    """mokv's cache config from MAX's cache params (the model's `kv_params`) and
    MAX's `KVCacheConfig` (`pipeline_config.model.kv_cache`). `model_id` names
    the weights in the shared tiers' layout fingerprint (the model path).

    Raises:
        ValueError: a connector type mokv does not implement (`dkv`), tier
            fields on the `null` connector, an unknown connector field, or a
            cache parameter mokv refuses (`from_max`); the message names it.
    """
    settings = kv_cache.kv_connector_config
    kind = KVConnectorType(settings.type)
    tier_fields = {
        name
        for name in settings.model_fields_set | set(settings.model_extra or {})
        if name != "type" and name not in _IGNORED_ON_CPU
    }
    if kind not in _TIERED and kind != KVConnectorType.null:
        raise ValueError(f"--kv-connector-config type={kind.value!r}: mokv's tiers are selected by 'rust_tiered'")
    if kind == KVConnectorType.null and tier_fields:
        raise ValueError(
            f"--kv-connector-config sets {', '.join(sorted(tier_fields))} with type 'null': "
            "say type 'rust_tiered' to use mokv's tiers"
        )
    mokv_params = from_max(dataclasses.replace(params, kv_connector_config=NullKVConnectorConfig()))
    if not isinstance(mokv_params, KVCacheParams):
        raise TypeError(f"mokv's pipeline runs one cache, got {type(mokv_params).__name__}")
    if kind == KVConnectorType.null:
        return MokvCacheConfig(mokv_params)
    host_gb, connector = _connector(settings, model_id)
    return MokvCacheConfig(mokv_params, host_gb, connector, tiered=True)
