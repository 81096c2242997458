"""What a page is called outside one process: a layout fingerprint and a chained key.

The device and host tiers name a cached page by its 64-bit chained hash and
check its parent by a per-process `uid` (`mokv.prefix`). Neither
survives the process, and the 64-bit hash is fast, not collision resistant.
The disk and remote tiers are shared between processes and machines, so they
name a page by a cryptographic chained key instead:

    key_{-1} = BLAKE2b(fingerprint, salt)                    (the chain's root)
    key_j    = BLAKE2b(key_{j-1}, tokens of page j)

`key_j` commits to the layout, the salt and every token up to the end of
page j, so a stored page whose key, parent key and tokens equal a request's
holds KV of exactly that request's prefix, computed by a model with exactly
this cache layout. A different model, dtype, head count or page size has a
different fingerprint, so it never even asks for another's keys.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from ..buffer import KVCacheMemory
from ..params import AnyKVCacheParams

KEY_BYTES = 32
"""Bytes of a page key (BLAKE2b-256)."""

FINGERPRINT_BYTES = 16
"""Bytes of a layout fingerprint (BLAKE2b-128)."""

FORMAT_VERSION = 1
"""Bumped whenever the meaning of stored bytes changes; it enters the fingerprint."""


def layout_fingerprint(params: AnyKVCacheParams, memory: Sequence[KVCacheMemory], model_id: str) -> bytes:
    """A digest of everything that decides what a stored page's bytes mean.

    The model id (its weights decide the KV), every leaf cache's dtype, head
    count, head size, layer count and page size, the tensor-parallel split,
    a quantized cache's scale dtype, scale block (tokens x head_dim
    elements per scale, MAX's "per-block scales") and whether its keys are rotated, and the byte width
    of every memory unit a page spans (values, then scales when the cache is
    quantized) in `KVCacheBuffer.to_memory()` order.
    """
    description = [f"mokv-kv-page-format={FORMAT_VERSION}", f"model={model_id}"]
    for name, leaf in params.leaves().items():
        line = (
            f"leaf={name} dtype={leaf.dtype} kv_heads={leaf.n_kv_heads} head_dim={leaf.head_dim} "
            f"layers={leaf.num_layers} page_size={leaf.page_size} tp={leaf.tensor_parallel_degree}"
        )
        if leaf.kvcache_quant_config is not None:  # unquantized layouts keep their fingerprints
            tokens, granularity = leaf.scale_block_shape
            scale_dtype = leaf.kvcache_quant_config.scale_dtype
            line += f" scales={scale_dtype} tokens_per_scale={tokens} granularity={granularity}"
            if leaf.kvcache_quant_config.rotate_keys:  # unrotated layouts keep their fingerprints
                line += " rotated_keys"
        description.append(line)
    description.append("units=" + ",".join(str(unit.bytes_per_page) for unit in memory))
    text = "\n".join(description).encode()
    return hashlib.blake2b(text, digest_size=FINGERPRINT_BYTES, person=b"mokv-layout").digest()


class PageKeyer:
    """Chained page keys for one layout (see the module docstring).

    Args:
        fingerprint: `layout_fingerprint` of the cache the keys name.
    """

    def __init__(self, fingerprint: bytes) -> None:
        if len(fingerprint) != FINGERPRINT_BYTES:
            raise ValueError(f"fingerprint must be {FINGERPRINT_BYTES} bytes, got {len(fingerprint)}")
        self.fingerprint = fingerprint

    def root(self, salt: str | None = None) -> bytes:
        """The key before a request's first page: the layout and the cache salt."""
        h = hashlib.blake2b(self.fingerprint, digest_size=KEY_BYTES, person=b"mokv-root")
        if salt is not None:
            h.update(b"\x01" + salt.encode())
        return h.digest()

    @staticmethod
    def chain(pages: npt.NDArray[np.integer], parent: bytes) -> list[bytes]:
        """Keys of consecutive full pages (`[k, page_size]` token ids) after `parent`."""
        rows = np.ascontiguousarray(pages, dtype="<i8")
        keys = []
        for row in rows:
            # The personalization is part of the stored format ("block" was the page's old name): never change it.
            parent = hashlib.blake2b(parent + row.tobytes(), digest_size=KEY_BYTES, person=b"mokv-block").digest()
            keys.append(parent)
        return keys
