"""Continuous-batching KV cache: one fixed `max_seq_len` slot per sequence.

No paging: a request claims a slot, its tokens live at positions
`0 .. cache_length` of that slot, and releasing it makes the slot free again.
Simple and fast to index, at the price of reserving `max_seq_len` tokens of
memory for every sequence.

The request lifecycle is the paged manager's (`claim`, `alloc`,
`runtime_inputs`, `ctx.update`, `step`, `release`) and takes mokv's or MAX's
`TextContext` alike; a request's cache length is its context's
`processed_length`. `fetch(seq_ids)` is the seed's slot-level view of the same
state, for graphs built on the opaque collection.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any

import numpy as np
from max.driver import Buffer, Device
from max.dtype import DType
from max.engine import InferenceSession, Model
from max.graph import BufferType, DeviceRef, Graph, TensorType, ops

from ..context import cache_context
from ..contract import ContinuousCacheInputs, KVCacheInputs, continuous_input_types
from ..params import KVCacheParams, resolve_params

CacheInputs = tuple[Buffer, Buffer, Buffer, Buffer]
"""Per device: (blocks, cache_lengths, lookup_table, is_cache_empty)."""

_UINT32_BYTES = 4


class ContinuousBatchingKVCacheManager:
    """Hands out slots of a `[max_cache_batch_size, 2, num_layers, max_seq_len,
    n_kv_heads_per_device, head_dim]` block tensor per device.

    Args:
        params: Cache shape (mokv's `KVCacheParams` or MAX's `MHAKVCacheParams`).
        max_cache_batch_size: Slots, i.e. the most requests claimed at once.
        max_seq_len: Tokens one slot holds.
        num_layers: Must equal `params.num_layers` (the seed's signature).
        devices: One block tensor per device (TP shards of the KV heads).
        session: Compiles the small `increment_cache_lengths` graph.
    """

    def __init__(
        self,
        params: KVCacheParams,
        max_cache_batch_size: int,
        max_seq_len: int,
        num_layers: int,
        devices: Sequence[Device],
        session: InferenceSession,
    ) -> None:
        params = resolve_params(params)
        if not isinstance(params, KVCacheParams):
            raise TypeError("the continuous-batching manager serves one cache, not a MultiKVCacheParams")
        for name, value in (
            ("max_cache_batch_size", max_cache_batch_size),
            ("max_seq_len", max_seq_len),
            ("num_layers", num_layers),
        ):
            if value < 1:
                raise ValueError(f"{name} must be positive, got {value}")
        if num_layers != params.num_layers:
            raise ValueError(f"num_layers={num_layers} disagrees with params.num_layers={params.num_layers}")
        if len(devices) != len(params.devices):
            raise ValueError(
                f"devices has {len(devices)} entries but params.devices has {len(params.devices)}: "
                "each device holds n_kv_heads_per_device heads of the params"
            )
        self.params = params
        self.max_cache_batch_size = max_cache_batch_size
        self.max_seq_len = max_seq_len
        self.num_layers = num_layers
        self.devices = list(devices)
        self.session = session
        shape = self.block_shape(max_cache_batch_size)
        self.blocks = [Buffer.zeros(shape, params.dtype, device=d) for d in self.devices]
        # Per-slot metadata, preallocated: fetch() hands out slices of these.
        self._lengths = np.zeros(max_cache_batch_size, np.uint32)
        self._lookup = [np.zeros(max_cache_batch_size, np.uint32) for _ in self.devices]
        self._cache_lengths = [np.zeros(max_cache_batch_size, np.uint32) for _ in self.devices]
        self._free = list(range(max_cache_batch_size))
        self._slot_of: dict[Hashable, int] = {}
        self._increment_model: Model | None = None

    def block_shape(self, n_sequences: int) -> list[int]:
        """`[n_sequences, 2, num_layers, max_seq_len, n_kv_heads_per_device, head_dim]`."""
        p = self.params
        return [n_sequences, 2, self.num_layers, self.max_seq_len, p.n_kv_heads_per_device, p.head_dim]

    @classmethod
    def estimated_memory_size(
        cls,
        params: KVCacheParams,
        max_cache_batch_size: int,
        max_seq_len: int,
        num_layers: int,
        devices: Sequence[Device],
    ) -> int:
        """Bytes allocated on all devices: each device's block tensor plus its
        per-sequence cache lengths and lookup table (uint32 each)."""
        block = 2 * num_layers * max_seq_len * params.n_kv_heads_per_device * params.head_dim
        per_device = max_cache_batch_size * (block * params.dtype.size_in_bytes + 2 * _UINT32_BYTES)
        return per_device * len(devices)

    def allocated_bytes(self) -> int:
        """Bytes actually allocated for the cache, for checking the estimate."""
        blocks = sum(b.num_elements * b.dtype.size_in_bytes for b in self.blocks)
        metadata = sum(a.nbytes for a in (*self._lookup, *self._cache_lengths))
        return blocks + metadata

    # -- request lifetime ----------------------------------------------------

    @property
    def num_free_slots(self) -> int:
        return len(self._free)

    @staticmethod
    def _check_replica(replica_idx: int) -> None:
        if replica_idx != 0:
            raise ValueError(f"replica_idx={replica_idx} is out of range: there is 1 replica")

    def claim(self, request_id: Hashable, replica_idx: int = 0) -> int:
        """Gives `request_id` the lowest free slot and returns it (its sequence id)."""
        self._check_replica(replica_idx)
        if request_id in self._slot_of:
            raise ValueError(f"request {request_id!r} is already claimed (slot {self._slot_of[request_id]})")
        if not self._free:
            raise ValueError(
                f"cannot claim {request_id!r}: all {self.max_cache_batch_size} slots are taken"
            )
        slot = self._free.pop(0)
        self._slot_of[request_id] = slot
        return slot

    def contains(self, request_id: Hashable, replica_idx: int = 0) -> bool:
        """Whether `request_id` is claimed."""
        self._check_replica(replica_idx)
        return request_id in self._slot_of

    def slot_of(self, request_id: Hashable) -> int:
        """The slot (sequence id) of a claimed request."""
        slot = self._slot_of.get(request_id)
        if slot is None:
            raise ValueError(f"request {request_id!r} is not claimed")
        return slot

    def alloc(self, data: object, replica_idx: int = 0, num_steps: int = 1) -> None:
        """Checks that a claimed request's next `num_steps` steps fit its slot
        (a slot is allocated whole at `claim`, so nothing else changes)."""
        self._check_replica(replica_idx)
        ctx = cache_context(data)
        self.slot_of(ctx.request_id)
        if num_steps < 1:
            raise ValueError(f"num_steps must be >= 1, got {num_steps}")
        needed = ctx.current_length + num_steps - 1
        if needed > self.max_seq_len:
            raise ValueError(
                f"request {ctx.request_id!r} needs {needed} tokens of KV but a slot holds "
                f"max_seq_len={self.max_seq_len}"
            )

    def step(self, batches: Sequence[Sequence[object]]) -> None:
        """Records each request's cache length (its `processed_length`) after a
        model step, so `fetch` sees it."""
        self._check_batches(batches)
        (batch,) = batches
        contexts = [cache_context(data) for data in batch]
        slots = [self.slot_of(ctx.request_id) for ctx in contexts]
        lengths = [ctx.processed_length for ctx in contexts]
        too_long = [(s, n) for s, n in zip(slots, lengths, strict=True) if n > self.max_seq_len]
        if too_long:
            slot, n = too_long[0]
            raise ValueError(f"slot {slot} would hold {n} tokens; the limit is max_seq_len={self.max_seq_len}")
        self._lengths[slots] = lengths

    def release(self, request_id: Hashable, replica_idx: int = 0) -> None:
        """Frees the request's slot; its next owner starts from an empty cache."""
        self._check_replica(replica_idx)
        slot = self.slot_of(request_id)
        del self._slot_of[request_id]
        self._lengths[slot] = 0
        self._free.append(slot)
        self._free.sort()

    def cache_length(self, request_id: Hashable) -> int:
        """Tokens cached for the request as of its last `step`."""
        return int(self._lengths[self.slot_of(request_id)])

    def _check_batches(self, batches: Sequence[Sequence[object]]) -> None:
        if len(batches) != 1:
            raise ValueError(f"expected one batch per replica (1), got {len(batches)}")

    def _check_slots(self, seq_ids: Sequence[int] | np.ndarray) -> None:
        claimed = set(self._slot_of.values())
        for seq_id in seq_ids:
            if int(seq_id) not in claimed:
                raise ValueError(
                    f"sequence id {int(seq_id)} is not claimed "
                    f"(valid ids are 0..{self.max_cache_batch_size - 1}, claimed ones only)"
                )

    # -- graph inputs --------------------------------------------------------

    def runtime_inputs(self, batches: Sequence[Sequence[object]]) -> KVCacheInputs:
        """Graph inputs for a batch of claimed requests (`mokv.contract`): a
        `KVCacheInputs` leaf with one `ContinuousCacheInputs` per device; row b
        is `batches[0][b]`, its cache length that context's `processed_length`."""
        self._check_batches(batches)
        (batch,) = batches
        contexts = [cache_context(data) for data in batch]
        for ctx in contexts:
            self.alloc(ctx)
        slots = np.array([self.slot_of(ctx.request_id) for ctx in contexts], np.uint32)
        lengths = np.array([ctx.processed_length for ctx in contexts], np.uint32)
        return KVCacheInputs(self._device_inputs(slots, lengths))

    def fetch(self, seq_ids: Sequence[int]) -> list[CacheInputs]:
        """Per device: (blocks, cache_lengths, lookup_table, is_cache_empty) for
        the batch `seq_ids` (slots), in that order; row i of the batch is
        `seq_ids[i]`, with the cache length its last `step` recorded. The small
        tensors are views of preallocated arrays, valid until the next `fetch`."""
        if not len(seq_ids):
            raise ValueError("fetch needs at least one sequence id")
        self._check_slots(seq_ids)
        ids = np.asarray(seq_ids, np.int64)
        inputs = self._device_inputs(ids, self._lengths[ids], views=True)
        return [tuple(device.flatten()) for device in inputs]  # type: ignore[misc]

    def _device_inputs(
        self, slots: np.ndarray, lengths: np.ndarray, views: bool = False
    ) -> list[ContinuousCacheInputs[Buffer]]:
        batch = len(slots)
        is_empty = Buffer.scalar(not lengths.any(), DType.bool)
        inputs = []
        for blocks, lookup, cache_lengths, device in zip(
            self.blocks, self._lookup, self._cache_lengths, self.devices, strict=True
        ):
            if views:  # the seed's fetch hands out views of preallocated rows
                lookup[:batch] = slots
                cache_lengths[:batch] = lengths
                lookup_rows, length_rows = lookup[:batch], cache_lengths[:batch]
            else:
                lookup_rows, length_rows = slots.astype(np.uint32), lengths.astype(np.uint32)
            lookup_buf, lengths_buf = Buffer.from_numpy(lookup_rows), Buffer.from_numpy(length_rows)
            if not device.is_host:
                lookup_buf, lengths_buf = lookup_buf.to(device), lengths_buf.to(device)
            inputs.append(ContinuousCacheInputs(blocks, lengths_buf, lookup_buf, is_empty))
        return inputs

    def input_symbols(self) -> list[ContinuousCacheInputs[BufferType | TensorType]]:
        """Per device, the graph input types of `fetch`'s and `runtime_inputs`'
        outputs (`mokv.contract.continuous_input_types`), with symbolic batch
        size; the block tensor is a `BufferType` because ops write to it."""
        return [
            continuous_input_types(self.params, self.max_seq_len, DeviceRef.from_device(device))
            for device in self.devices
        ]

    def increment_cache_lengths(
        self, kv_cache_inputs: Sequence[CacheInputs], prev_model_inputs: Any
    ) -> list[CacheInputs]:
        """Next-step cache inputs for multi-step decode, computed by a small
        compiled graph (`cache_lengths + diff(input_row_offsets)`) rather than a
        host round trip. `prev_model_inputs` is the previous step's model inputs:
        an object with `input_row_offsets`, or a tuple `(tokens, input_row_offsets, ...)`.
        `is_cache_empty` becomes False: only the first step encodes context."""
        row_offsets = getattr(prev_model_inputs, "input_row_offsets", None)
        if row_offsets is None:
            row_offsets = prev_model_inputs[1]
        model = self._increment_graph()
        not_empty = Buffer.scalar(False, DType.bool)
        updated = []
        for blocks, cache_lengths, lookup_table, _ in kv_cache_inputs:
            (new_lengths,) = model.execute(cache_lengths, row_offsets)
            updated.append((blocks, new_lengths, lookup_table, not_empty))
        return updated

    def _increment_graph(self) -> Model:
        if self._increment_model is None:
            cpu = DeviceRef.CPU()
            with Graph(
                "mokv_increment_cache_lengths",
                input_types=[
                    TensorType(DType.uint32, ["batch_size"], cpu),
                    TensorType(DType.uint32, ["batch_size_plus_one"], cpu),
                ],
            ) as graph:
                lengths, offsets = (v.tensor for v in graph.inputs)
                new_tokens = offsets[1:] - offsets[:-1]
                graph.output(lengths + ops.rebind(new_tokens, lengths.shape))
            self._increment_model = self.session.load(graph)
        return self._increment_model
