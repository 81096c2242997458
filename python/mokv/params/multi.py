"""`MultiKVCacheParams`: several paged caches behind one page table."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypeAlias

from max.graph import DeviceRef

from .cache_params import KVCacheParams, KVCacheStrategy, check_swap_space, host_pages_in_swap_space


@dataclass(frozen=True)
class MultiKVCacheParams:
    """Several paged caches behind one page table (for example a target model
    and its draft model, or layer groups with different head counts).

    One manager serves them all: a request is claimed once, a page id names
    the same page in every cache's page tensor, and a prefix hit is a hit in
    all of them. So the children must agree on everything that shapes the page
    table: page size, devices and replicas, prefix caching and the host tier.
    Children may themselves be `MultiKVCacheParams` (leaf names are then
    dotted: `target.sliding`).
    """

    children: Mapping[str, KVCacheParams | MultiKVCacheParams]

    def __post_init__(self) -> None:
        if not isinstance(self.children, Mapping):
            raise TypeError(f"children must be a mapping of names to params, got {self.children!r}")
        children = dict(self.children)
        object.__setattr__(self, "children", children)
        if not children:
            raise ValueError("MultiKVCacheParams needs at least one child cache")
        for name, child in children.items():
            if not isinstance(name, str) or not name or "." in name:
                raise ValueError(f"child names must be non-empty strings without dots, got {name!r}")
            if not isinstance(child, (KVCacheParams, MultiKVCacheParams)):
                raise TypeError(
                    f"child {name!r} must be a KVCacheParams or MultiKVCacheParams, got {type(child).__name__}"
                )
        first_name, first = next(iter(children.items()))
        for field_name in _SHARED_FIELDS:
            for name, child in children.items():
                if getattr(child, field_name) != getattr(first, field_name):
                    raise ValueError(
                        f"child caches must share {field_name}: {first_name!r} has "
                        f"{getattr(first, field_name)!r}, {name!r} has {getattr(child, field_name)!r}"
                    )
        if first.cache_strategy is not KVCacheStrategy.PAGED:
            raise ValueError(f"MultiKVCacheParams needs paged caches, got {first.cache_strategy.value}")
        check_swap_space(self)

    def _shared(self, name: str) -> Any:
        return getattr(next(iter(self.children.values())), name)

    @property
    def page_size(self) -> int:
        return self._shared("page_size")

    @property
    def cache_strategy(self) -> KVCacheStrategy:
        return self._shared("cache_strategy")

    @property
    def enable_prefix_caching(self) -> bool:
        return self._shared("enable_prefix_caching")

    @property
    def data_parallel_degree(self) -> int:
        return self._shared("data_parallel_degree")

    @property
    def devices(self) -> tuple[DeviceRef, ...]:
        return self._shared("devices")

    @property
    def enable_kvcache_swapping_to_host(self) -> bool:
        return self._shared("enable_kvcache_swapping_to_host")

    @property
    def host_kvcache_swap_space_gb(self) -> float | None:
        return self._shared("host_kvcache_swap_space_gb")

    @property
    def tensor_parallel_degree(self) -> int:
        return self._shared("tensor_parallel_degree")

    @property
    def devices_per_replica(self) -> list[tuple[DeviceRef, ...]]:
        return self._shared("devices_per_replica")

    def leaves(self) -> dict[str, KVCacheParams]:
        """Every leaf cache, in declaration order, by dotted name."""
        out: dict[str, KVCacheParams] = {}
        for name, child in self.children.items():
            if isinstance(child, KVCacheParams):
                out[name] = child
            else:
                out.update({f"{name}.{leaf}": p for leaf, p in child.leaves().items()})
        return out

    @property
    def bytes_per_page(self) -> int:
        """Bytes one page takes on one device, over every leaf cache."""
        return sum(p.bytes_per_page for p in self.leaves().values())

    @property
    def num_host_pages(self) -> int:
        """Host pages (one page of every leaf and TP shard) in the swap space."""
        return host_pages_in_swap_space(self)


_SHARED_FIELDS = (
    "page_size",
    "cache_strategy",
    "enable_prefix_caching",
    "data_parallel_degree",
    "devices",
    "enable_kvcache_swapping_to_host",
    "host_kvcache_swap_space_gb",
)
"""What children of a `MultiKVCacheParams` must agree on: it shapes the one page table."""

AnyKVCacheParams: TypeAlias = KVCacheParams | MultiKVCacheParams
"""What the paged manager accepts (after `from_max` for MAX's own params)."""
