"""One stored page, as the disk and remote tiers hold it, and how a hit is verified.

A record is self-describing and checked end to end:

    magic (8) | fingerprint (16) | key (32) | parent key (32) | page size (u32) | payload bytes (u64)
    | tokens (int64 x page size) | payload | tag (32)

The payload is the page's bytes in every memory unit of the cache, in
`KVCacheBuffer.to_memory()` order (values, then scales when quantized). The tag
covers everything before it: SHA-256 as a checksum, or with an operator's
integrity key HMAC-SHA256, so a record written without the key never verifies.
(SHA-256 rather than BLAKE2b: with the CPU's SHA extensions it hashes pages
about twice as fast here.) A reader accepts a record only when every field agrees with what it
asked for (layout, key, parent key, tokens, size) and the tag recomputes;
anything else is a miss with a reason, never bytes in a device page.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from .keys import FINGERPRINT_BYTES, KEY_BYTES

MAGIC = b"MOKVKV\x00\x01"
_HEADER = struct.Struct(f"<8s{FINGERPRINT_BYTES}s{KEY_BYTES}s{KEY_BYTES}sIQ")
TAG_BYTES = 32


class Rejection(enum.Enum):
    """Why a stored record was not used."""

    CORRUPT = "corrupt"
    """Wrong size, wrong magic or a tag that does not recompute without a key (torn, truncated, stale format)."""
    FOREIGN = "foreign"
    """Another layout's record (a different model or cache shape)."""
    MISMATCH = "mismatch"
    """Its key, parent key or tokens differ from the request's."""
    UNAUTHENTICATED = "unauthenticated"
    """Its MAC does not verify under this process's integrity key."""


class RecordError(Exception):
    """A stored record failed verification; `reason` says how."""

    def __init__(self, reason: Rejection, detail: str) -> None:
        super().__init__(f"{reason.value}: {detail}")
        self.reason = reason


@dataclass(frozen=True)
class PageIdentity:
    """What a record claims to be: the page's key, its parent's key and its tokens."""

    key: bytes
    parent_key: bytes
    tokens: npt.NDArray[np.int64]


class RecordCodec:
    """Encodes and verifies records of one layout.

    Args:
        fingerprint: The layout fingerprint (`keys.layout_fingerprint`).
        page_size: Tokens per page.
        payload_bytes: Bytes of one page over every memory unit.
        integrity_key: Secret for the MAC; None for an unkeyed checksum.
    """

    def __init__(
        self, fingerprint: bytes, page_size: int, payload_bytes: int, integrity_key: bytes | None = None
    ) -> None:
        self.fingerprint = fingerprint
        self.page_size = page_size
        self.payload_bytes = payload_bytes
        self.keyed = integrity_key is not None
        self._mac_key = integrity_key
        self.record_bytes = _HEADER.size + 8 * page_size + payload_bytes + TAG_BYTES

    def _tag(self, parts: Sequence[bytes | memoryview]) -> bytes:
        h = hashlib.sha256() if self._mac_key is None else hmac.new(self._mac_key, digestmod=hashlib.sha256)
        for part in parts:
            h.update(part)
        return h.digest()

    def encode(self, identity: PageIdentity, payload: Sequence[bytes | memoryview]) -> list[bytes | memoryview]:
        """The record as a list of parts to write back to back (the payload's
        parts, one per memory unit, are not copied)."""
        size = sum(len(part) for part in payload)
        if size != self.payload_bytes:
            raise ValueError(f"payload has {size} bytes, a page has {self.payload_bytes}")
        header = _HEADER.pack(
            MAGIC, self.fingerprint, identity.key, identity.parent_key, self.page_size, self.payload_bytes
        )
        tokens = np.ascontiguousarray(identity.tokens, dtype="<i8").tobytes()
        if len(tokens) != 8 * self.page_size:
            raise ValueError(f"a page holds {self.page_size} tokens, got {len(tokens) // 8}")
        parts: list[bytes | memoryview] = [header, tokens, *payload]
        parts.append(self._tag(parts))
        return parts

    def verify(self, record: bytes | memoryview, expected: PageIdentity) -> memoryview:
        """The payload of `record` if it is exactly `expected`'s page, else `RecordError`."""
        view = memoryview(record)
        if len(view) != self.record_bytes:
            raise RecordError(Rejection.CORRUPT, f"{len(view)} bytes, expected {self.record_bytes}")
        magic, fingerprint, key, parent_key, page_size, payload_bytes = _HEADER.unpack_from(view)
        if magic != MAGIC:
            raise RecordError(Rejection.CORRUPT, "not a mokv page record of this format version")
        if fingerprint != self.fingerprint or page_size != self.page_size or payload_bytes != self.payload_bytes:
            raise RecordError(Rejection.FOREIGN, "written for another model or cache layout")
        if key != expected.key or parent_key != expected.parent_key:
            raise RecordError(Rejection.MISMATCH, "its key or parent key differs from the request's")
        tokens_end = _HEADER.size + 8 * page_size
        tokens = np.frombuffer(view[_HEADER.size : tokens_end], dtype="<i8")
        if not np.array_equal(tokens, expected.tokens):
            raise RecordError(Rejection.MISMATCH, "its tokens differ from the request's")
        body_end = len(view) - TAG_BYTES
        tag = self._tag([view[:body_end]])
        if not hmac.compare_digest(tag, bytes(view[body_end:])):
            reason = Rejection.UNAUTHENTICATED if self.keyed else Rejection.CORRUPT
            raise RecordError(reason, "its tag does not verify")
        return view[tokens_end:body_end]
