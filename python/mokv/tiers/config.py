"""How a manager's lower tiers are configured, and the one place that builds them.

The host tier is sized as MAX sizes it (`total_num_host_pages`, or
`host_kvcache_swap_space_gb` in the params); the disk and remote tiers by a
`KVConnectorConfig` (MAX's name for it, with MAX's `disk_offload_dir` /
`disk_offload_max_gb`, and a remote store URL). Every replica gets its own
tiers over its own device memory, in lookup order: host, disk, remote.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from ..buffer import KVCacheMemory
from ..metrics import KVCacheMetrics
from ..params import AnyKVCacheParams
from ..prefix import PageIndex
from .base import PageToSave, SavePoint, Tier
from .disk import DiskStore
from .host import HostTier
from .keys import PageKeyer, layout_fingerprint
from .record import RecordCodec
from .remote import RedisStore, redact_url
from .store import PageStore, StoreTier

_GIB = 1 << 30

INTEGRITY_KEY_ENV = "MOKV_KV_INTEGRITY_KEY"
"""Environment variable holding the shared tiers' integrity key (when no key or key file is configured)."""

logger = logging.getLogger("mokv.tiers")
_warned_unkeyed = False


@dataclass(frozen=True)
class KVConnectorConfig:
    """The disk and remote tiers of a `PagedKVCacheManager` (both need prefix caching).

    Attributes:
        model_id: Names the weights the KV was computed with; it enters the
            layout fingerprint, so stores never serve one model's KV to another.
        disk_offload_dir: Directory of the disk tier (None: no disk tier). May
            be shared by processes, and reused by a later run (a warm restart).
        disk_offload_max_gb: Disk budget; None is twice the device page pool (as in MAX).
        remote_url: `redis://[user:password@]host:port/db` (or `rediss://` for
            TLS) of a Redis or Valkey server (None: no remote tier). Kept out
            of `repr`: it may hold a password.
        remote_timeout_s: Bound on each remote round trip (and on connecting).
        remote_ttl_s: Expiry of remote records; None leaves it to the server.
        remote_retry_s: After a remote failure, misses for this long before retrying.
        remote_cluster: The URL names a Redis Cluster node.
        io_threads: Reader threads of the disk tier and writer threads of each tier.
        integrity_key: Secret of the shared tiers' MAC (HMAC-SHA256 over each
            record: layout, chain keys (hence the salt), tokens and bytes).
            Every process sharing a store needs the same key; records written
            without it are rejected. Kept out of `repr`.
        integrity_key_file: A file holding the key (its bytes, a trailing newline dropped).
        Without either, the key comes from the `MOKV_KV_INTEGRITY_KEY`
        environment variable; with none at all, the shared tiers keep an
        unkeyed checksum and trust their store blindly (a warning says so once).
    """

    model_id: str = ""
    disk_offload_dir: str | os.PathLike[str] | None = None
    disk_offload_max_gb: float | None = None
    remote_url: str | None = field(default=None, repr=False)
    remote_timeout_s: float = 0.5
    remote_ttl_s: float | None = None
    remote_retry_s: float = 5.0
    remote_cluster: bool = False
    io_threads: int = 4
    integrity_key: bytes | None = field(default=None, repr=False)
    integrity_key_file: str | os.PathLike[str] | None = None

    def __post_init__(self) -> None:
        if self.disk_offload_max_gb is not None and not self.disk_offload_max_gb > 0:
            raise ValueError(f"disk_offload_max_gb must be positive, got {self.disk_offload_max_gb!r}")
        if self.remote_timeout_s <= 0 or self.remote_retry_s < 0:
            raise ValueError(
                f"remote_timeout_s must be positive and remote_retry_s >= 0, got "
                f"{self.remote_timeout_s!r} and {self.remote_retry_s!r}"
            )
        if self.io_threads < 1:
            raise ValueError(f"io_threads must be positive, got {self.io_threads}")
        if self.remote_url is not None and not self.remote_url.startswith(("redis://", "rediss://")):
            raise ValueError(f"remote_url must be a redis:// or rediss:// URL, got {redact_url(self.remote_url)!r}")

    @property
    def enabled(self) -> bool:
        """Whether any shared tier is configured."""
        return self.disk_offload_dir is not None or self.remote_url is not None

    def resolve_integrity_key(self) -> bytes | None:
        """The MAC key: `integrity_key`, else the key file, else the environment.

        Raises:
            ValueError: The key file cannot be read or a key is empty (the
                message never contains the key).
        """
        if self.integrity_key is not None:
            key = self.integrity_key
        elif self.integrity_key_file is not None:
            try:
                key = Path(self.integrity_key_file).read_bytes().rstrip(b"\r\n")
            except OSError as error:
                raise ValueError(
                    f"cannot read integrity_key_file {self.integrity_key_file}: {error.strerror}"
                ) from None
        elif os.environ.get(INTEGRITY_KEY_ENV):
            key = os.environ[INTEGRITY_KEY_ENV].encode()
        else:
            return None
        if not key:
            raise ValueError("the KV integrity key is empty")
        return key

    @property
    def remote_where(self) -> str | None:
        """The remote URL without credentials, for logs and reports."""
        return None if self.remote_url is None else redact_url(self.remote_url)


class ReplicaTiers(list[Tier]):
    """One replica's tiers in lookup order (a list of them), with what the
    replica asks of them as a group: save-through on commit, victim copies on
    eviction, and waiting for loads.

    Args:
        tiers: The tiers, in lookup order.
        keyer: Keys of their cross-process chain (None when no tier needs them).
        host: The host tier among them, if any.
    """

    def __init__(self, tiers: list[Tier], keyer: PageKeyer | None, host: HostTier | None) -> None:
        super().__init__(tiers)
        self.keyer = keyer
        self.host = host
        self.on_evict = [tier for tier in tiers if tier.saves_on is SavePoint.EVICT]
        """Victim tiers: they copy a cached page just before the pool hands it out again."""
        self.on_commit = [tier for tier in tiers if tier.saves_on is SavePoint.COMMIT]
        """Write-through tiers: they copy every page the device prefix cache takes."""

    def offload(self, page: int, metrics: KVCacheMetrics) -> None:
        """The pool is about to hand out cached device `page`: victim tiers copy it first."""
        item = [PageToSave(page)]
        for tier in self.on_evict:
            metrics.d2h_blocks_copied += tier.save(item)

    def save_through(self, items: list[PageToSave], metrics: KVCacheMetrics, source: Tier | None = None) -> None:
        """Newly cached pages go to every write-through tier but the one they came from."""
        for tier in self.on_commit:
            if tier is not source:
                metrics.d2h_blocks_copied += tier.save(items)

    def wait_for_loads(self) -> None:
        """Returns once every tier's loads into device pages have landed."""
        for tier in self:
            tier.sync()


TierFactory = Callable[[list[KVCacheMemory], PageIndex], ReplicaTiers]
"""Builds one replica's tiers from its device memory and its device prefix index."""


def tier_factory(
    params: AnyKVCacheParams,
    total_num_pages: int,
    total_num_host_pages: int,
    config: KVConnectorConfig | None,
) -> TierFactory:
    """The factory a manager hands each replica."""

    def build(memory: list[KVCacheMemory], device_index: PageIndex) -> ReplicaTiers:
        tiers: list[Tier] = []
        host = None
        if total_num_host_pages:
            host = HostTier(total_num_host_pages, params.page_size, memory, device_index)
            tiers.append(host)
        if config is None or not config.enabled:
            return ReplicaTiers(tiers, None, host)
        fingerprint = layout_fingerprint(params, memory, config.model_id)
        payload_bytes = sum(unit.bytes_per_page for unit in memory)
        integrity_key = config.resolve_integrity_key()
        if integrity_key is None:
            _warn_unkeyed()
        codec = RecordCodec(fingerprint, params.page_size, payload_bytes, integrity_key)
        # The remote store first: it is the one that may refuse to start.
        remote = None
        if config.remote_url is not None:
            remote = RedisStore(
                config.remote_url,
                fingerprint,
                timeout_s=config.remote_timeout_s,
                ttl_s=config.remote_ttl_s,
                retry_s=config.remote_retry_s,
                cluster=config.remote_cluster,
            )
        stores: list[PageStore] = []
        if config.disk_offload_dir is not None:
            gb = config.disk_offload_max_gb
            budget = int(gb * _GIB) if gb is not None else 2 * total_num_pages * codec.record_bytes
            stores.append(
                DiskStore(config.disk_offload_dir, fingerprint, budget, codec.record_bytes, readers=config.io_threads)
            )
        if remote is not None:
            stores.append(remote)
        tiers += [StoreTier(store, codec, memory, writers=config.io_threads) for store in stores]
        return ReplicaTiers(tiers, PageKeyer(fingerprint), host)

    return build


def _warn_unkeyed() -> None:
    global _warned_unkeyed
    if not _warned_unkeyed:
        _warned_unkeyed = True
        logger.warning(
            "shared KV tiers run without an integrity key: any writer to the disk directory or the "
            "remote store can plant KV this process will use; set %s or integrity_key_file",
            INTEGRITY_KEY_ENV,
        )
