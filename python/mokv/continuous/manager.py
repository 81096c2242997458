"""Continuous-batching KV cache: one fixed `max_seq_len` slot per sequence.

No paging: a sequence claims a slot (its id), its tokens live at positions
`0 .. cache_length` of that slot, and releasing it makes the slot free again
with its length reset to 0. Simple and fast to index, at the price of reserving
`max_seq_len` tokens of memory for every sequence.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from max.driver import Buffer, Device
from max.dtype import DType
from max.engine import InferenceSession, Model
from max.graph import BufferType, DeviceRef, Graph, TensorType, ops

from ..params import KVCacheParams

CacheInputs = tuple[Buffer, Buffer, Buffer, Buffer]
"""Per device: (blocks, cache_lengths, lookup_table, is_cache_empty)."""

_UINT32_BYTES = 4


class ContinuousBatchingKVCacheManager:
    """Hands out slots of a `[max_cache_batch_size, 2, num_layers, max_seq_len,
    n_kv_heads_per_device, head_dim]` block tensor per device."""

    def __init__(
        self,
        params: KVCacheParams,
        max_cache_batch_size: int,
        max_seq_len: int,
        num_layers: int,
        devices: Sequence[Device],
        session: InferenceSession,
    ) -> None:
        for name, value in (
            ("max_cache_batch_size", max_cache_batch_size),
            ("max_seq_len", max_seq_len),
            ("num_layers", num_layers),
        ):
            if value < 1:
                raise ValueError(f"{name} must be positive, got {value}")
        if num_layers != params.num_layers:
            raise ValueError(f"num_layers={num_layers} disagrees with params.num_layers={params.num_layers}")
        if not devices:
            raise ValueError("devices must name at least one device")
        self.params = params
        self.max_cache_batch_size = max_cache_batch_size
        self.max_seq_len = max_seq_len
        self.num_layers = num_layers
        self.devices = list(devices)
        self.session = session
        shape = self.block_shape(max_cache_batch_size)
        self.blocks = [Buffer.zeros(shape, params.dtype, device=d) for d in self.devices]
        # Per-sequence metadata, preallocated: fetch() hands out slices of these.
        self._lengths = np.zeros(max_cache_batch_size, np.uint32)
        self._lookup = [np.zeros(max_cache_batch_size, np.uint32) for _ in self.devices]
        self._cache_lengths = [np.zeros(max_cache_batch_size, np.uint32) for _ in self.devices]
        self._free = list(range(max_cache_batch_size))
        self._active: set[int] = set()
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

    # -- sequence lifetime ---------------------------------------------------

    @property
    def num_free_slots(self) -> int:
        return len(self._free)

    def claim(self, n: int) -> list[int]:
        """Reserves `n` slots and returns their sequence ids (lowest first)."""
        if n < 1:
            raise ValueError(f"claim needs n >= 1, got {n}")
        if n > len(self._free):
            raise ValueError(
                f"cannot claim {n} sequences: only {len(self._free)} of "
                f"{self.max_cache_batch_size} slots are free"
            )
        claimed, self._free = self._free[:n], self._free[n:]
        self._active.update(claimed)
        return claimed

    def contains(self, seq_id: int) -> bool:
        return seq_id in self._active

    def release(self, seq_id: int) -> None:
        """Frees `seq_id`'s slot; its next owner starts from an empty cache."""
        self._check_active([seq_id])
        self._active.remove(seq_id)
        self._lengths[seq_id] = 0
        self._free.append(seq_id)
        self._free.sort()

    def cache_length(self, seq_id: int) -> int:
        """Tokens cached for `seq_id`."""
        self._check_active([seq_id])
        return int(self._lengths[seq_id])

    def step(self, new_tokens: Mapping[int, int]) -> None:
        """Commits `new_tokens[seq_id]` freshly written tokens per sequence."""
        ids = np.fromiter(new_tokens.keys(), np.int64, len(new_tokens))
        counts = np.fromiter(new_tokens.values(), np.int64, len(new_tokens))
        self._check_active(ids)
        grown = self._lengths[ids].astype(np.int64) + counts
        if (counts < 0).any() or (grown > self.max_seq_len).any():
            bad = int(np.argmax((counts < 0) | (grown > self.max_seq_len)))
            raise ValueError(
                f"sequence {int(ids[bad])} would hold {int(grown[bad])} tokens "
                f"(adding {int(counts[bad])}); the limit is max_seq_len={self.max_seq_len}"
            )
        self._lengths[ids] = grown

    def _check_active(self, seq_ids: Sequence[int] | np.ndarray) -> None:
        for seq_id in seq_ids:
            if int(seq_id) not in self._active:
                raise ValueError(
                    f"sequence id {int(seq_id)} is not claimed "
                    f"(valid ids are 0..{self.max_cache_batch_size - 1}, claimed ones only)"
                )

    # -- graph inputs --------------------------------------------------------

    def fetch(self, seq_ids: Sequence[int]) -> list[CacheInputs]:
        """Per device: (blocks, cache_lengths, lookup_table, is_cache_empty) for
        the batch `seq_ids`, in that order; row i of the batch is `seq_ids[i]`.
        The small tensors are views of preallocated arrays, valid until the next
        `fetch`."""
        if not len(seq_ids):
            raise ValueError("fetch needs at least one sequence id")
        self._check_active(seq_ids)
        ids = np.asarray(seq_ids, np.int64)
        batch = len(ids)
        lengths = self._lengths[ids]
        is_empty = Buffer.scalar(not lengths.any(), DType.bool)
        inputs = []
        for blocks, lookup, cache_lengths in zip(self.blocks, self._lookup, self._cache_lengths):
            lookup[:batch] = ids
            cache_lengths[:batch] = lengths
            inputs.append(
                (blocks, Buffer.from_numpy(cache_lengths[:batch]), Buffer.from_numpy(lookup[:batch]), is_empty)
            )
        return inputs

    def input_symbols(self) -> list[tuple[BufferType, TensorType, TensorType, TensorType]]:
        """Per device, the graph input types of `fetch`'s outputs, with symbolic
        batch size. The block tensor is a `BufferType` because ops write to it."""
        p = self.params
        symbols = []
        for device in self.devices:
            ref = DeviceRef.from_device(device)
            symbols.append(
                (
                    BufferType(p.dtype, ["num_slots", 2, self.num_layers, self.max_seq_len, p.n_kv_heads_per_device, p.head_dim], ref),
                    TensorType(DType.uint32, ["batch_size"], ref),
                    TensorType(DType.uint32, ["batch_size"], ref),
                    TensorType(DType.bool, [], DeviceRef.CPU()),
                )
            )
        return symbols

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
