"""The remote tier's store: page records on a Redis-protocol server (Redis, Valkey).

One key per record, `mokv:<layout fingerprint>:<page key>`, whose value is the
whole record (tokens, chain and checksum or MAC with the page bytes); expiry
and eviction are the server's own policy (`maxmemory-policy`, an optional TTL).
A prefix's records come back in one pipelined round trip, and background
writers send a commit's records in one pipeline. Plain GETs and SETs in
non-transactional pipelines work on one server and on Redis Cluster alike.

The store never stalls serving: every call is bounded by the socket timeout,
and after a failure it answers misses (and drops writes) for `retry_s`
seconds before it tries the server again, with one warning per outage. Only a
refused login at start-up is an error, since it will not heal by itself.
Credentials come from the URL (`redis://user:password@host:port/db`,
`rediss://` for TLS) and never appear in logs, errors or `where`.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Sequence
from urllib.parse import urlsplit

from .base import TierUsage
from .store import PageStore, Record

logger = logging.getLogger("mokv.tiers")

SCAN_BATCH = 500


class RemoteStoreError(ValueError):
    """The remote store refused this process at start-up (a login or URL that will not work)."""


def redact_url(url: str) -> str:
    """`url` without user name or password: safe for logs, errors and metrics."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    port = f":{parts.port}" if parts.port else ""
    return f"{parts.scheme}://{host}{port}{parts.path}"


class RedisStore(PageStore):
    """Page records on a Redis-protocol server (see the module docstring).

    Args:
        url: `redis://` or `rediss://` URL, credentials included where the
            server needs them.
        fingerprint: Layout fingerprint: prefixes every key of this cache.
        timeout_s: Bound on connecting and on each round trip.
        ttl_s: Expiry of each record, or None to leave it to the server's policy.
        retry_s: How long to answer misses after a failure before trying again.
        cluster: Talk to a Redis Cluster (`redis.cluster.RedisCluster`).

    Raises:
        RemoteStoreError: The server refused the login, or the URL is unusable.
    """

    name = "remote"

    def __init__(
        self,
        url: str,
        fingerprint: bytes,
        *,
        timeout_s: float = 0.5,
        ttl_s: float | None = None,
        retry_s: float = 5.0,
        cluster: bool = False,
    ) -> None:
        import redis
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        self.where = redact_url(url)
        self._secret = urlsplit(url).password or ""
        self.errors = 0
        self._redis = redis
        self._prefix = b"mokv:" + fingerprint.hex().encode() + b":"
        self._every_node: dict[str, object] = {}
        """Arguments that send a server-wide query to every primary of a cluster."""
        self._ttl = None if ttl_s is None else max(1, round(ttl_s))
        self._retry_s = retry_s
        self._lock = threading.Lock()
        self._down_until = 0.0
        self._warned = False
        options = {
            "socket_timeout": timeout_s,
            "socket_connect_timeout": timeout_s,
            # One immediate retry: a pooled connection to a restarted server fails once.
            "retry": Retry(NoBackoff(), 1),
        }
        try:
            if cluster:
                from redis.cluster import RedisCluster

                self._client = RedisCluster.from_url(url, **options)
                self._every_node = {"target_nodes": RedisCluster.PRIMARIES}
            else:
                self._client = redis.Redis.from_url(url, **options)
        except ValueError:
            raise RemoteStoreError(f"remote KV store {self.where}: not a usable redis:// or rediss:// URL") from None
        try:
            self._client.ping()
        except (redis.AuthenticationError, redis.exceptions.NoPermissionError) as error:
            raise RemoteStoreError(
                f"remote KV store {self.where} refused the login: {self._describe(error)}; "
                "check the user name and password in the URL"
            ) from None
        except redis.RedisError as error:
            self._failed(error)

    # ---------------------------------------------------------------- health

    @property
    def enabled(self) -> bool:
        return time.monotonic() >= self._down_until

    def _failed(self, error: Exception) -> None:
        with self._lock:
            self.errors += 1
            self._down_until = time.monotonic() + self._retry_s
            warn, self._warned = not self._warned, True
        if warn:
            logger.warning(
                "remote KV store %s unavailable (%s): misses for the next %.1f s, then trying again",
                self.where,
                self._describe(error),
                self._retry_s,
            )

    def _succeeded(self) -> None:
        if self._warned:
            with self._lock:
                recovered, self._warned = self._warned, False
            if recovered:
                logger.warning("remote KV store %s reachable again", self.where)

    # ------------------------------------------------------------ operations

    def get_many(self, keys: Sequence[bytes]) -> list[Record | None]:
        if not self.enabled:
            return [None] * len(keys)
        pipe = self._client.pipeline(transaction=False)
        for key in keys:
            pipe.get(self._prefix + key)
        try:
            values = pipe.execute()
        except self._redis.RedisError as error:
            self._failed(error)
            return [None] * len(keys)
        self._succeeded()
        return list(values)

    def put_many(self, records: Sequence[tuple[bytes, list[Record]]]) -> int:
        if not records or not self.enabled:
            return 0
        pipe = self._client.pipeline(transaction=False)
        for key, parts in records:
            pipe.set(self._prefix + key, b"".join(parts), ex=self._ttl)
        try:
            pipe.execute()
        except self._redis.RedisError as error:
            self._failed(error)
            return 0
        self._succeeded()
        return len(records)

    def discard(self, key: bytes) -> None:
        if not self.enabled:
            return
        try:
            self._client.delete(self._prefix + key)
        except self._redis.RedisError as error:
            self._failed(error)

    def clear(self) -> None:
        if not self.enabled:
            return
        try:
            batch = []
            for key in self._client.scan_iter(match=self._prefix + b"*", count=SCAN_BATCH):
                batch.append(key)
                if len(batch) == SCAN_BATCH:
                    self._client.unlink(*batch)
                    batch.clear()
            if batch:
                self._client.unlink(*batch)
        except self._redis.RedisError as error:
            self._failed(error)

    def usage(self) -> TierUsage:
        """The server's (or cluster's) keys and memory, all of its users';
        zeros while it is unreachable."""
        if not self.enabled:
            return TierUsage(0, 0, 0, 0)
        try:
            keys = self._client.dbsize(**self._every_node)
            memory = self._client.info("memory", **self._every_node)
        except self._redis.RedisError as error:
            self._failed(error)
            return TierUsage(0, 0, 0, 0)
        per_node = list(memory.values()) if self._every_node else [memory]
        used, limit = (sum(int(node.get(field, 0)) for node in per_node) for field in ("used_memory", "maxmemory"))
        return TierUsage(int(keys), 0, used, limit)

    def close(self) -> None:
        with contextlib.suppress(self._redis.RedisError):
            self._client.close()

    def _describe(self, error: Exception) -> str:
        """An error's type and message, with the password blotted out should
        a message ever quote it (redis-py's name host and port only)."""
        text = f"{type(error).__name__}: {error}"
        return text.replace(self._secret, "***") if self._secret else text
