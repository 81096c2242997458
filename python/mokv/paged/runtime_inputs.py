"""Building a batch's paged-cache inputs (the contract: `mokv.contract`) with numpy.

Per replica a batch gets one set of tables, shared by every TP shard and every
leaf cache: `cache_lengths` (each request's `processed_length`), the
`lookup_table` (row b lists request b's page ids, null-padded to the most pages
any request needs this step, or to `ceil(max_cache_length / page_size)`), and
`max_lengths` (row i: most new tokens, longest context at step i; step 0 runs
the active tokens, later steps one token each). `device_inputs` pairs them
with each shard's page tensor (and scales tensor, when quantized), and
`InputTrees` arranges every replica's and leaf cache's inputs in the shape of
the params.

The manager checks a batch in one pass over its requests that also finds the
maxima (`input_plan.plan_tables`); `InputStaging` then fills persistent host
arrays from the replica's page table: the lookup table is one copy into them
(a slice of the table when the batch's rows are consecutive, else one
`np.take`; plus a mask when a request holds more pages than this step needs),
and their `Buffer` views are reused: the same `BatchTables` object for the
same arrays and shape, refilled.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
from max.driver import Buffer, Device

from ..buffer import KVCacheBuffer
from ..contract import KVCacheInputs, MultiKVCacheInputs, PagedCacheInputs
from ..params import SINGLE_CACHE, AnyKVCacheParams, MultiKVCacheParams
from .input_plan import TablePlan
from .page_table import PageTable


@dataclass(frozen=True, eq=False)
class BatchTables:
    """One replica's per-batch tables, on the host, as `Buffer`s aliasing `InputStaging`'s arrays.

    `InputStaging` hands out the same object for the same arrays and shape,
    refilled: equal by identity, so callers can key what they derive from it."""

    cache_lengths: Buffer
    lookup_table: Buffer
    max_lengths: Buffer


_MAX_SHAPES = 64
"""Table shapes one set keeps views of (shapes change as contexts grow; old ones are dropped)."""


@dataclass(frozen=True, slots=True)
class _Views:
    """One shape's contiguous views of a set's three arrays, and the
    `BatchTables` of `Buffer`s aliasing them."""

    lengths: npt.NDArray[np.uint32]
    """`[batch]`"""
    lookup: npt.NDArray[np.uint32]
    """`[batch, width]`"""
    max_lengths: npt.NDArray[np.uint32]
    """`[num_steps, 2]`"""
    tables: BatchTables


class _Arrays:
    """One set of flat uint32 host arrays, grown (doubling) as batches need,
    and the views already made of them, by shape."""

    def __init__(self) -> None:
        self.lengths = np.zeros(0, np.uint32)
        self.lookup = np.zeros(0, np.uint32)
        self.max_lengths = np.zeros(0, np.uint32)
        self.made: dict[tuple[int, int, int], _Views] = {}
        """By (batch, width, num_steps)."""

    def views(self, batch: int, width: int, num_steps: int) -> _Views:
        """Views for a batch of `batch` rows, `width` pages and `num_steps` steps."""
        key = (batch, width, num_steps)
        made = self.made.get(key)
        if made is not None:
            return made
        for name, size in (("lengths", batch), ("lookup", batch * width), ("max_lengths", 2 * num_steps)):
            flat = getattr(self, name)
            if size > flat.size:
                setattr(self, name, np.zeros(max(size, 2 * flat.size), np.uint32))
                self.made.clear()  # views of the old array stay valid while their holders keep them
        if len(self.made) >= _MAX_SHAPES:
            self.made.clear()
        lengths = self.lengths[:batch]
        lookup = self.lookup[: batch * width].reshape(batch, width)
        max_lengths = self.max_lengths[: 2 * num_steps].reshape(num_steps, 2)
        buffers = BatchTables(Buffer.from_numpy(lengths), Buffer.from_numpy(lookup), Buffer.from_numpy(max_lengths))
        made = self.made[key] = _Views(lengths, lookup, max_lengths, buffers)
        return made


class InputStaging:
    """Where one replica's per-batch tables are built, reused from call to call.

    Two sets of host arrays are used in turn, and each set keeps the `Buffer`
    views it has handed out, so a steady decode loop allocates nothing: the
    tables of one `runtime_inputs` call stay intact through the next call
    (which writes the other set) and are overwritten by the call after that.
    The contract (`mokv.contract`, "Lifetimes") promises callers less: run the
    graph before the next call.
    """

    def __init__(self, null_page: int) -> None:
        self.null_page = null_page
        self._sets = (_Arrays(), _Arrays())
        self._turn = 0

    def build(self, table: PageTable, plan: TablePlan) -> BatchTables:
        """Fills the next set's arrays for a batch checked by the caller, from
        the replica's page `table`."""
        arrays = self._sets[self._turn]
        self._turn ^= 1
        batch = len(plan.cache_lengths)
        width, num_steps, max_context = plan.width, plan.num_steps, plan.max_context
        views = arrays.views(batch, width, num_steps)
        views.lengths[:] = plan.cache_lengths
        lookup = views.lookup
        table.gather_into(plan.rows, lookup)
        if plan.needed is not None:
            lookup[np.arange(width) >= np.asarray(plan.needed)[:, None]] = self.null_page
        max_lengths = views.max_lengths
        max_lengths[0] = (plan.max_new, max_context)
        if num_steps > 1:
            later = 1 if batch else 0  # each later step runs one token per request
            max_lengths[1:, 0] = later
            max_lengths[1:, 1] = max_context + later * np.arange(1, num_steps)
        return views.tables


def device_inputs(tables: BatchTables, buffer: KVCacheBuffer, devices: list[Device]) -> list[PagedCacheInputs[Buffer]]:
    """One `PagedCacheInputs` per TP shard: its page tensor (and, for a
    quantized cache, its scales tensor) and the batch's tables (copied to the
    shard's device, `max_lengths` staying on the host)."""
    return [
        PagedCacheInputs(
            blocks=blocks,
            cache_lengths=tables.cache_lengths if device.is_host else tables.cache_lengths.to(device),
            lookup_table=tables.lookup_table if device.is_host else tables.lookup_table.to(device),
            max_lengths=tables.max_lengths,
            scales=scales,
        )
        for blocks, scales, device in zip(buffer.graph_values, buffer.shard_scales, devices, strict=True)
    ]


_MAX_REMEMBERED_INPUTS = 128
"""Input trees `InputTrees` keeps for reuse (one per table shape seen lately)."""


class InputTrees:
    """Arranges every replica's tables with every leaf cache's tensors as the
    input tree `runtime_inputs` returns.

    With every device on the host it remembers the tree returned for each
    tuple of per-replica tables (refilled in place: the same objects for the
    same arrays and shapes), so a steady loop builds no new input objects.

    Args:
        params: The manager's params (a leaf or a tree of leaf caches).
        replicas: Per replica, its buffers by leaf name and its devices.
    """

    def __init__(self, params: AnyKVCacheParams, replicas: list[tuple[dict[str, KVCacheBuffer], list[Device]]]) -> None:
        self.params = params
        self._replicas = replicas
        self._leaf_names = list(params.leaves())
        self._all_on_host = all(device.is_host for _, devices in replicas for device in devices)
        self._remembered: dict[tuple[BatchTables, ...], KVCacheInputs | MultiKVCacheInputs] = {}

    def tree(self, tables: tuple[BatchTables, ...]) -> KVCacheInputs | MultiKVCacheInputs:
        """The inputs for one `BatchTables` per replica."""
        inputs = self._remembered.get(tables)
        if inputs is not None:
            return inputs
        per_leaf: dict[str, list[PagedCacheInputs]] = {name: [] for name in self._leaf_names}
        for (buffers, devices), replica_tables in zip(self._replicas, tables, strict=True):
            for name, buffer in buffers.items():
                per_leaf[name] += device_inputs(replica_tables, buffer, devices)
        inputs = _as_tree(self.params, per_leaf)
        if self._all_on_host:
            if len(self._remembered) >= _MAX_REMEMBERED_INPUTS:
                self._remembered.clear()
            self._remembered[tables] = inputs
        return inputs


def _as_tree(
    params: AnyKVCacheParams,
    per_leaf: dict[str, list[PagedCacheInputs]],
    path: str | None = None,
) -> KVCacheInputs | MultiKVCacheInputs:
    """The per-leaf device inputs (keyed as `params.leaves()` names them)
    arranged in the shape of `params`' tree."""
    if isinstance(params, MultiKVCacheParams):
        return MultiKVCacheInputs(
            {
                name: _as_tree(child, per_leaf, name if path is None else f"{path}.{name}")
                for name, child in params.children.items()
            }
        )
    return KVCacheInputs(per_leaf[path or SINGLE_CACHE])
