"""The disk tier's store: one file per page record under a directory, shared safely.

Layout: `DIR/<layout fingerprint>/<first key byte>/<key>.kvpage`, so caches of
different models or shapes never even open each other's files. A record is
written to a temporary file beside its final name and renamed over it
(`os.replace` is atomic on POSIX), so a reader sees a whole record or none:
two processes writing the same page at once each rename a complete file, a
reader keeps the file it opened even if it is replaced or deleted meanwhile,
and a writer killed mid-write leaves only a temporary file, swept up later.
Records are not fsynced: a power loss may lose recent ones, and a record torn
by one fails its checksum (a miss), never wrong KV.

Each process keeps an LRU view of the files it knows (found at start-up,
written, or hit) and deletes the least recently used ones past its byte
budget; processes sharing a directory each enforce the budget on their own
view. A full disk or a permission error disables the tier with one warning;
reads that fail are misses.
"""

from __future__ import annotations

import errno
import itertools
import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from .base import TierUsage
from .store import PageStore, Record

logger = logging.getLogger("mokv.tiers")

SUFFIX = ".kvpage"
STALE_TEMP_SECONDS = 600.0
"""A temporary file this old belongs to a writer that died (or to none alive)."""

_FATAL = {errno.ENOSPC, errno.EDQUOT, errno.EACCES, errno.EPERM, errno.EROFS}
"""Write errors that will not go away by themselves: the tier turns itself off."""


class DiskStore(PageStore):
    """Page records in files under `directory` (see the module docstring).

    Args:
        directory: The offload directory (created if missing); shareable
            between processes and with earlier runs (a warm restart).
        fingerprint: Layout fingerprint: names the subdirectory this cache uses.
        max_bytes: Byte budget of this process's LRU view.
        record_bytes: Size of one record file.
        readers: Threads reading a prefix's files in parallel.
    """

    name = "disk"

    def __init__(
        self, directory: str | os.PathLike[str], fingerprint: bytes, max_bytes: int, record_bytes: int, readers: int = 4
    ) -> None:
        if max_bytes < record_bytes:
            raise ValueError(f"the disk budget ({max_bytes} bytes) must hold at least one page ({record_bytes} bytes)")
        self.root = Path(directory) / fingerprint.hex()
        self.max_bytes = max_bytes
        self.record_bytes = record_bytes
        self.errors = 0
        self._lock = threading.Lock()
        self._files: OrderedDict[bytes, int] = OrderedDict()
        """Files this process knows, least recently used first, with their sizes."""
        self._bytes = 0
        self._disabled: str | None = None
        self._temp_names = itertools.count()
        self._readers = ThreadPoolExecutor(max_workers=readers, thread_name_prefix="mokv-disk-reader")
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            self._scan()
        except OSError as error:
            self._disable(error)

    @property
    def enabled(self) -> bool:
        return self._disabled is None

    def _disable(self, error: OSError) -> None:
        with self._lock:
            if self._disabled is not None:
                return
            self._disabled = f"{error.strerror or error} ({type(error).__name__})"
            self.errors += 1
        logger.warning("disk KV tier under %s disabled: %s; serving goes on without it", self.root, self._disabled)

    def _path(self, key: bytes) -> Path:
        name = key.hex()
        return self.root / name[:2] / (name + SUFFIX)

    def _scan(self) -> None:
        """Learns the files earlier runs (or neighbours) left, oldest first, and
        sweeps temporary files of writers that died."""
        found: list[tuple[float, bytes, int]] = []
        now = time.time()
        for sub in self.root.iterdir():
            if not sub.is_dir():
                continue
            for entry in os.scandir(sub):
                try:
                    stat = entry.stat()
                except FileNotFoundError:
                    continue
                if entry.name.endswith(SUFFIX):
                    try:
                        key = bytes.fromhex(entry.name[: -len(SUFFIX)])
                    except ValueError:
                        continue
                    found.append((stat.st_mtime, key, stat.st_size))
                elif entry.name.endswith(".tmp") and now - stat.st_mtime > STALE_TEMP_SECONDS:
                    _unlink(Path(entry.path))
        found.sort()
        with self._lock:
            for _, key, size in found:
                self._remember(key, size)
        self._evict_over_budget()

    # ------------------------------------------------------------ LRU (locked)

    def _remember(self, key: bytes, size: int) -> None:
        old = self._files.pop(key, None)
        self._bytes += size - (old or 0)
        self._files[key] = size

    def _forget(self, key: bytes) -> None:
        size = self._files.pop(key, None)
        if size is not None:
            self._bytes -= size

    def _remember_if_present(self, key: bytes, size: int) -> None:
        """Remembers a file a reader or writer thread just touched, unless an
        eviction deleted it meanwhile (evictions unlink under the lock, so the
        check cannot race one of ours)."""
        with self._lock:
            if self._path(key).exists():
                self._remember(key, size)
            else:
                self._forget(key)

    def _evict_over_budget(self) -> None:
        with self._lock:
            while self._bytes > self.max_bytes and self._files:
                key, size = self._files.popitem(last=False)
                self._bytes -= size
                _unlink(self._path(key))

    # ------------------------------------------------------------------- reads

    def get_many(self, keys: Sequence[bytes]) -> list[Record | None]:
        if len(keys) == 1:
            return [self._read(keys[0])]
        return list(self._readers.map(self._read, keys))

    def _read(self, key: bytes) -> Record | None:
        try:
            record = self._path(key).read_bytes()
        except FileNotFoundError:
            with self._lock:
                self._forget(key)  # evicted by a neighbour
            return None
        except OSError as error:
            with self._lock:
                self.errors += 1
            logger.debug("disk KV tier: cannot read a page file: %s", error)
            return None
        self._remember_if_present(key, len(record))
        return record

    # ------------------------------------------------------------------ writes

    def put_many(self, records: Sequence[tuple[bytes, list[Record]]]) -> int:
        stored = 0
        for key, parts in records:
            if not self.enabled:
                break
            if self._write(key, parts):
                stored += 1
        self._evict_over_budget()
        return stored

    def _write(self, key: bytes, parts: list[Record]) -> bool:
        path = self._path(key)
        temp = path.with_name(f".{path.stem}.{os.getpid()}.{threading.get_ident()}.{next(self._temp_names)}.tmp")
        try:
            path.parent.mkdir(exist_ok=True)
            with open(temp, "wb") as f:
                f.writelines(parts)
            os.replace(temp, path)
        except OSError as error:
            _unlink(temp)
            if error.errno in _FATAL:
                self._disable(error)
            else:
                with self._lock:
                    self.errors += 1
                logger.debug("disk KV tier: cannot write a page file: %s", error)
            return False
        self._remember_if_present(key, sum(len(part) for part in parts))
        return True

    def discard(self, key: bytes) -> None:
        with self._lock:
            self._forget(key)
            _unlink(self._path(key))

    def clear(self) -> None:
        with self._lock:
            keys = list(self._files)
            self._files.clear()
            self._bytes = 0
        for key in keys:
            _unlink(self._path(key))
        if self.root.is_dir():
            for path in self.root.glob(f"*/*{SUFFIX}"):
                _unlink(path)

    def usage(self) -> TierUsage:
        with self._lock:
            return TierUsage(len(self._files), self.max_bytes // self.record_bytes, self._bytes, self.max_bytes)

    def close(self) -> None:
        self._readers.shutdown(wait=True)


def _unlink(path: Path) -> None:
    try:
        path.unlink()
    except FileNotFoundError:
        pass
    except OSError as error:
        logger.debug("disk KV tier: cannot remove %s: %s", path, error)
