"""Memory sizing: a manager's sizes refused before anything is allocated when
their memory would not fit."""

from __future__ import annotations

from collections import Counter

from max.driver import CPU, Device

from ..params import AnyKVCacheParams
from ..validation import check_fits

_BOOKKEEPING_BYTES_PER_PAGE = 96
"""Python-side bytes per device or host page besides its tokens (list entries, ints)."""


def check_memory(
    params: AnyKVCacheParams, total_num_pages: int, total_num_host_pages: int, max_batch_size: int
) -> None:
    """Refuses sizes whose memory would not fit, before anything is allocated.

    Each size is checked alone first, so the message names the one at fault:
    `total_num_pages` sizes every device's page tensors (and the host-side
    index of each replica), `total_num_host_pages` the host tier, and
    `max_batch_size` the largest runtime inputs (a lookup table row per
    request, as wide as the pool, double-buffered) and the page table.

    Raises:
        ValueError: A size whose memory would not fit (`validation.check_fits`).
    """
    leaves = params.leaves().values()
    page_bytes = sum(leaf.bytes_per_page for leaf in leaves)
    replicas = params.devices_per_replica
    index_bytes = params.page_size * 8 + _BOOKKEEPING_BYTES_PER_PAGE
    cpu = CPU()
    device_bytes: Counter[Device] = Counter()
    for refs in replicas:
        for ref in refs:
            device_bytes[ref.to_device()] += (total_num_pages + 1) * page_bytes
    host = {
        f"total_num_pages={total_num_pages}": len(replicas) * total_num_pages * index_bytes,
        f"total_num_host_pages={total_num_host_pages}": len(replicas)
        * total_num_host_pages
        * (page_bytes * params.tensor_parallel_degree + index_bytes),
        f"max_batch_size={max_batch_size}": len(replicas) * max_batch_size * (2 * (total_num_pages + 2) + 64) * 4,
    }
    for device, nbytes in device_bytes.items():
        check_fits(f"total_num_pages={total_num_pages} (page tensors)", nbytes, device)
    for what, nbytes in host.items():
        check_fits(what, nbytes, cpu)
    device_bytes[cpu] += sum(host.values())
    for device, nbytes in device_bytes.items():
        check_fits(", ".join(host), nbytes, device)
