"""Continuous-batching KV cache: one fixed `max_seq_len` slot per sequence.

No paging: a request claims a slot, its tokens live at positions
`0 .. cache_length` of that slot, and releasing it makes the slot free again.
Simple and fast to index, at the price of reserving `max_seq_len` tokens of
memory for every sequence.

The request lifecycle is the paged manager's (`claim`, `alloc`,
`runtime_inputs`, `ctx.update`, `step`, `release`) and takes mokv's or MAX's
`TextContext` alike; a request's cache length is its context's
`processed_length`. `fetch(seq_ids)` is the slot-level view of the same state
in MAX's documented API, for graphs built on the opaque collection.
`increment_cache_lengths` runs a small compiled graph (`increment`).

A quantized cache (`KVCacheParams.kvcache_quant_config`) gets a scales tensor
per device beside its slots (`KVCacheParams.scales_shape` with `max_seq_len`
tokens per slot), handed to the graph as each device's `scales` input. The
opaque collection (`mokv.graph.FetchContinuousBatchingKVCacheCollection`)
does not support quantized caches yet: build graphs on the component inputs
(`runtime_inputs`, `ContinuousCacheValues`).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any

import numpy as np
from max.driver import Buffer, Device
from max.dtype import DType
from max.engine import InferenceSession
from max.graph import BufferType, DeviceRef, TensorType

from ..buffer import KVCacheBuffer
from ..context import CacheContext, cache_context, check_same_tokens
from ..contract import ContinuousCacheInputs, KVCacheInputs, continuous_input_types
from ..params import KVCacheParams, resolve_params
from ..validation import check_fits, check_int, check_request_id, check_sequence, check_unique
from .increment import CacheInputs, CacheLengthIncrement

_UINT32_BYTES = 4


class ContinuousBatchingKVCacheManager:
    """Hands out slots of a `[max_cache_batch_size, 2, num_layers, max_seq_len,
    n_kv_heads_per_device, head_dim]` slot tensor per device (MAX's `blocks`),
    and of a scales tensor beside it for a quantized cache.

    Every public call either does what its docstring says or raises
    `TypeError` / `ValueError` naming the bad argument, having changed nothing
    (batches are checked whole first).

    Args:
        params: Cache shape (mokv's `KVCacheParams` or MAX's `MHAKVCacheParams`):
            one replica, no prefix caching, no host swapping; when quantized,
            its `tokens_per_scale` must divide `max_seq_len`.
        max_cache_batch_size: Slots, i.e. the most requests claimed at once.
        max_seq_len: Tokens one slot holds.
        num_layers: Must equal `params.num_layers` (MAX's documented signature).
        devices: One slot tensor per device (TP shards of the KV heads), the
            devices `params.devices` names, in order.
        session: Compiles the small `increment_cache_lengths` graph.

    Raises:
        TypeError, ValueError: A bad argument, by name; slot tensors that
            would not fit in a device's free memory are refused before
            anything is allocated.
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
        params = _checked_args(params, max_cache_batch_size, max_seq_len, num_layers, devices)
        if not isinstance(session, InferenceSession):
            raise TypeError(f"session must be a max.engine.InferenceSession, got {session!r}")
        nbytes = self.estimated_memory_size(params, max_cache_batch_size, max_seq_len, num_layers, devices)
        what = f"max_cache_batch_size={max_cache_batch_size}, max_seq_len={max_seq_len}"
        for device in set(devices):
            check_fits(what, nbytes // len(devices) * list(devices).count(device), device)
        self.params = params
        self.max_cache_batch_size = max_cache_batch_size
        self.max_seq_len = max_seq_len
        self.num_layers = num_layers
        self.devices = list(devices)
        self.session = session
        self.buffer = KVCacheBuffer.allocate(
            params, max_cache_batch_size, params.devices, null_page=False, tokens_per_page=max_seq_len
        )
        """Every device's slot tensor (`values`) and, when quantized, scales tensor."""
        # Per-slot metadata, preallocated: fetch() hands out slices of these.
        self._lengths = np.zeros(max_cache_batch_size, np.uint32)
        self._lookup = [np.zeros(max_cache_batch_size, np.uint32) for _ in self.devices]
        self._cache_lengths = [np.zeros(max_cache_batch_size, np.uint32) for _ in self.devices]
        self._free = list(range(max_cache_batch_size))
        self._slot_of: dict[Hashable, int] = {}
        self._context_of: dict[Hashable, tuple[object, CacheContext]] = {}
        """Per request, the context object last passed and its adapted view (identity checks)."""
        self._increment: CacheLengthIncrement | None = None
        """`increment_cache_lengths`' checks and graph, made on first use."""

    @property
    def blocks(self) -> list[Buffer]:
        """Each device's slot tensor (MAX's name: `blocks`)."""
        return self.buffer.values

    @property
    def scales(self) -> list[Buffer] | None:
        """Each device's scales tensor (a quantized cache), else None."""
        return self.buffer.scales

    def block_shape(self, n_sequences: int) -> list[int]:
        """`[n_sequences, 2, num_layers, max_seq_len, n_kv_heads_per_device, head_dim]`.

        Raises:
            TypeError, ValueError: `n_sequences` is no positive integer.
        """
        return self.params.block_shape(check_int("n_sequences", n_sequences, minimum=1), self.max_seq_len)

    def scales_shape(self, n_sequences: int) -> list[int]:
        """A quantized cache's scales tensor for `n_sequences` slots:
        `[n_sequences, 2, num_layers, max_seq_len // tokens_per_scale,
        n_kv_heads_per_device, head_dim // granularity]` float32.

        Raises:
            TypeError, ValueError: `n_sequences` is no positive integer.
            ValueError: The cache is not quantized.
        """
        return self.params.scales_shape(check_int("n_sequences", n_sequences, minimum=1), self.max_seq_len)

    @classmethod
    def estimated_memory_size(
        cls,
        params: KVCacheParams,
        max_cache_batch_size: int,
        max_seq_len: int,
        num_layers: int,
        devices: Sequence[Device],
    ) -> int:
        """Bytes allocated on all devices: each device's slot tensor (and
        scales tensor, when quantized) plus its per-sequence cache lengths and
        lookup table (uint32 each).

        Raises:
            TypeError, ValueError: The arguments the constructor would refuse.
        """
        params = _checked_args(params, max_cache_batch_size, max_seq_len, num_layers, devices)
        per_device = max_cache_batch_size * (params.bytes_for_tokens(max_seq_len) + 2 * _UINT32_BYTES)
        return per_device * len(devices)

    def allocated_bytes(self) -> int:
        """Bytes actually allocated for the cache, for checking the estimate."""
        tensors = sum(b.num_elements * b.dtype.size_in_bytes for b in self.buffer.all_buffers)
        metadata = sum(a.nbytes for a in (*self._lookup, *self._cache_lengths))
        return tensors + metadata

    # -- request lifetime ----------------------------------------------------

    @property
    def num_free_slots(self) -> int:
        return len(self._free)

    @staticmethod
    def _check_replica(replica_idx: int) -> None:
        if type(replica_idx) is not int:
            replica_idx = check_int("replica_idx", replica_idx)
        if replica_idx != 0:
            raise ValueError(f"replica_idx={replica_idx} is out of range: there is 1 replica")

    def claim(self, request_id: Hashable, replica_idx: int = 0) -> int:
        """Gives `request_id` the lowest free slot and returns it (its sequence id)."""
        self._check_replica(replica_idx)
        check_request_id(request_id)
        if request_id in self._slot_of:
            raise ValueError(f"request {request_id!r} is already claimed (slot {self._slot_of[request_id]})")
        if not self._free:
            raise ValueError(f"cannot claim {request_id!r}: all {self.max_cache_batch_size} slots are taken")
        slot = self._free.pop(0)
        self._slot_of[request_id] = slot
        return slot

    def contains(self, request_id: Hashable, replica_idx: int = 0) -> bool:
        """Whether `request_id` is claimed."""
        self._check_replica(replica_idx)
        check_request_id(request_id)
        return request_id in self._slot_of

    def slot_of(self, request_id: Hashable) -> int:
        """The slot (sequence id) of a claimed request."""
        check_request_id(request_id)
        slot = self._slot_of.get(request_id)
        if slot is None:
            raise ValueError(f"request {request_id!r} is not claimed")
        return slot

    def alloc(self, data: object, replica_idx: int = 0, num_steps: int = 1) -> None:
        """Checks that a claimed request's next `num_steps` steps fit its slot
        (a slot is allocated whole at `claim`, so nothing else changes).

        Raises:
            TypeError, ValueError: A bad argument, an unclaimed request, a
                context whose tokens differ from the request's, or more tokens
                than a slot holds.
        """
        self._check_replica(replica_idx)
        if type(num_steps) is not int or num_steps < 1:
            num_steps = check_int("num_steps", num_steps, minimum=1)
        ctx = self._live(data)
        self._check_fits_slot(ctx, num_steps)
        self._remember(data, ctx)

    def _live(self, data: object) -> CacheContext:
        """`data` as the context of a claimed request whose tokens it agrees with."""
        ctx = cache_context(data)
        self.slot_of(ctx.request_id)
        known = self._context_of.get(ctx.request_id)
        if known is not None and known[0] is not data:
            check_same_tokens(known[1], ctx)
        return ctx

    def _remember(self, data: object, ctx: CacheContext) -> None:
        self._context_of[ctx.request_id] = (data, ctx)

    def _check_fits_slot(self, ctx: CacheContext, num_steps: int = 1) -> None:
        needed = ctx.current_length + num_steps - 1
        if needed > self.max_seq_len:
            raise ValueError(
                f"request {ctx.request_id!r} needs {needed} tokens of KV but a slot holds "
                f"max_seq_len={self.max_seq_len}"
            )

    def _validated_batch(self, batches: Sequence[Sequence[object]]) -> list[CacheContext]:
        """The one replica's batch, checked whole: one batch, claimed requests
        that fit their slots, none twice."""
        check_sequence("batches", batches)
        if len(batches) != 1:
            raise ValueError(f"expected one batch per replica (1), got {len(batches)}")
        (batch,) = batches
        check_sequence("batches[0]", batch)
        contexts = [self._live(data) for data in batch]
        check_unique("request", (ctx.request_id for ctx in contexts))
        for ctx in contexts:
            self._check_fits_slot(ctx)
        return contexts

    def step(self, batches: Sequence[Sequence[object]]) -> None:
        """Records each request's cache length (its `processed_length`) after a
        model step, so `fetch` sees it.

        Raises:
            TypeError, ValueError: A bad batch (see `runtime_inputs`), checked
                whole before any length is recorded.
        """
        contexts = self._validated_batch(batches)
        for data, ctx in zip(batches[0], contexts, strict=True):
            self._remember(data, ctx)
        slots = [self._slot_of[ctx.request_id] for ctx in contexts]
        self._lengths[slots] = [ctx.processed_length for ctx in contexts]

    def release(self, request_id: Hashable, replica_idx: int = 0) -> None:
        """Frees the request's slot; its next owner starts from an empty cache."""
        self._check_replica(replica_idx)
        slot = self.slot_of(request_id)
        del self._slot_of[request_id]
        self._context_of.pop(request_id, None)
        self._lengths[slot] = 0
        self._free.append(slot)
        self._free.sort()

    def cache_length(self, request_id: Hashable) -> int:
        """Tokens cached for the request as of its last `step`."""
        return int(self._lengths[self.slot_of(request_id)])

    def _checked_slots(self, seq_ids: Sequence[int]) -> list[int]:
        check_sequence("seq_ids", seq_ids)
        slots = [check_int(f"seq_ids[{i}]", seq_id) for i, seq_id in enumerate(seq_ids)]
        claimed = set(self._slot_of.values())
        for slot in slots:
            if slot not in claimed:
                raise ValueError(
                    f"sequence id {slot} is not claimed "
                    f"(valid ids are 0..{self.max_cache_batch_size - 1}, claimed ones only)"
                )
        check_unique("sequence id", slots)
        return slots

    # -- graph inputs --------------------------------------------------------

    def runtime_inputs(self, batches: Sequence[Sequence[object]]) -> KVCacheInputs:
        """Graph inputs for a batch of claimed requests (`mokv.contract`): a
        `KVCacheInputs` leaf with one `ContinuousCacheInputs` per device; row b
        is `batches[0][b]`, its cache length that context's `processed_length`.

        Raises:
            TypeError, ValueError: Checked for the whole batch first: not one
                batch, a request unclaimed, twice in the batch, with tokens
                other than its own, or longer than a slot.
        """
        contexts = self._validated_batch(batches)
        slots = np.array([self._slot_of[ctx.request_id] for ctx in contexts], np.uint32)
        lengths = np.array([ctx.processed_length for ctx in contexts], np.uint32)
        return KVCacheInputs(self._device_inputs(slots, lengths))

    def fetch(self, seq_ids: Sequence[int]) -> list[CacheInputs]:
        """Per device: (blocks, cache_lengths, lookup_table, is_cache_empty,
        then scales for a quantized cache) for the batch `seq_ids` (slots);
        row i of the batch is `seq_ids[i]`, with the cache length its last
        `step` recorded. The small tensors are views of preallocated arrays,
        valid until the next `fetch`.

        Raises:
            TypeError, ValueError: No ids, an id that is no integer, not
                claimed, or repeated.
        """
        slots = self._checked_slots(seq_ids)
        if not slots:
            raise ValueError("fetch needs at least one sequence id")
        ids = np.asarray(slots, np.int64)
        inputs = self._device_inputs(ids, self._lengths[ids], views=True)
        return [tuple(device.flatten()) for device in inputs]  # type: ignore[misc]

    def _device_inputs(
        self, slots: np.ndarray, lengths: np.ndarray, views: bool = False
    ) -> list[ContinuousCacheInputs[Buffer]]:
        batch = len(slots)
        is_empty = Buffer.scalar(not lengths.any(), DType.bool)
        inputs = []
        for blocks, scales, lookup, cache_lengths, device in zip(
            self.buffer.graph_values,
            self.buffer.shard_scales,
            self._lookup,
            self._cache_lengths,
            self.devices,
            strict=True,
        ):
            if views:  # MAX's documented fetch hands out views of preallocated rows
                lookup[:batch] = slots
                cache_lengths[:batch] = lengths
                lookup_rows, length_rows = lookup[:batch], cache_lengths[:batch]
            else:
                lookup_rows, length_rows = slots.astype(np.uint32), lengths.astype(np.uint32)
            lookup_buf, lengths_buf = Buffer.from_numpy(lookup_rows), Buffer.from_numpy(length_rows)
            if not device.is_host:
                lookup_buf, lengths_buf = lookup_buf.to(device), lengths_buf.to(device)
            inputs.append(ContinuousCacheInputs(blocks, lengths_buf, lookup_buf, is_empty, scales))
        return inputs

    def input_symbols(self) -> list[ContinuousCacheInputs[BufferType | TensorType]]:
        """Per device, the graph input types of `fetch`'s and `runtime_inputs`'
        outputs (`mokv.contract.continuous_input_types`), with symbolic batch
        size; the slot tensor is a `BufferType` because ops write to it."""
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
        `is_cache_empty` becomes False: only the first step encodes context; the
        slot and scales tensors stay the same.

        Raises:
            TypeError, ValueError: Checked before anything runs: not one
                `(blocks, cache_lengths, lookup_table, is_cache_empty)` per
                device (then `scales` for a quantized cache, as `fetch` gives)
                with this manager's tensors and uint32 lengths of one batch
                size; row offsets that are no uint32 `[batch + 1]`
                non-decreasing vector; or lengths that would pass `max_seq_len`.
        """
        if self._increment is None:
            self._increment = CacheLengthIncrement(self.session, self.buffer, self.max_seq_len)
        return self._increment(kv_cache_inputs, prev_model_inputs)


def _checked_args(
    params: object, max_cache_batch_size: int, max_seq_len: int, num_layers: int, devices: Sequence[Device]
) -> KVCacheParams:
    """The constructor's arguments checked (shared with `estimated_memory_size`)."""
    params = resolve_params(params)
    if not isinstance(params, KVCacheParams):
        raise TypeError("the continuous-batching manager serves one cache, not a MultiKVCacheParams")
    if params.enable_prefix_caching or params.enable_kvcache_swapping_to_host:
        raise ValueError(
            "the continuous-batching manager keeps no prefix cache: got enable_prefix_caching="
            f"{params.enable_prefix_caching}, enable_kvcache_swapping_to_host={params.enable_kvcache_swapping_to_host}"
        )
    if params.data_parallel_degree != 1:
        raise ValueError(
            f"the continuous-batching manager has one replica, got data_parallel_degree={params.data_parallel_degree}"
        )
    check_int("max_cache_batch_size", max_cache_batch_size, minimum=1, maximum=np.iinfo(np.uint32).max)
    check_int("max_seq_len", max_seq_len, minimum=1, maximum=np.iinfo(np.uint32).max)
    check_int("num_layers", num_layers, minimum=1)
    if num_layers != params.num_layers:
        raise ValueError(f"num_layers={num_layers} disagrees with params.num_layers={params.num_layers}")
    config = params.kvcache_quant_config
    if config is not None and max_seq_len % config.tokens_per_scale:
        raise ValueError(
            f"kvcache_quant_config.tokens_per_scale={config.tokens_per_scale} must divide max_seq_len={max_seq_len}"
        )
    check_sequence("devices", devices)
    if len(devices) != len(params.devices):
        raise ValueError(
            f"devices has {len(devices)} entries but params.devices has {len(params.devices)}: "
            "each device holds n_kv_heads_per_device heads of the params"
        )
    for i, (device, ref) in enumerate(zip(devices, params.devices, strict=True)):
        if not isinstance(device, Device):
            raise TypeError(f"devices[{i}] must be a max.driver.Device, got {device!r}")
        if DeviceRef.from_device(device) != ref:
            raise ValueError(f"devices[{i}] is {device.label}:{device.id} but params.devices[{i}] is {ref}")
    return params
