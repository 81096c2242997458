"""`increment_cache_lengths` of the continuous-batching manager: next-step
cache lengths for multi-step decode, computed on the device by a small
compiled graph (`cache_lengths + diff(input_row_offsets)`) rather than a host
round trip, after checking its arguments whole."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from max.driver import CPU, Buffer
from max.dtype import DType
from max.engine import InferenceSession, Model
from max.graph import DeviceRef, Graph, TensorType, ops

from ..buffer import KVCacheBuffer
from ..validation import check_sequence

CacheInputs = tuple[Buffer, ...]
"""Per device: (blocks, cache_lengths, lookup_table, is_cache_empty), then
scales for a quantized cache (MAX's `fetch` order)."""


class CacheLengthIncrement:
    """Checks and runs `increment_cache_lengths` for one manager's tensors.

    Args:
        session: Compiles the graph, once per device on first use.
        buffer: The manager's slot tensors (and scales tensors) per device.
        max_seq_len: Tokens one slot holds: no length may pass it.
    """

    def __init__(self, session: InferenceSession, buffer: KVCacheBuffer, max_seq_len: int) -> None:
        self.session = session
        self.buffer = buffer
        self.max_seq_len = max_seq_len
        self._models: dict[DeviceRef, Model] = {}

    def __call__(self, kv_cache_inputs: Sequence[CacheInputs], prev_model_inputs: Any) -> list[CacheInputs]:
        """The next step's inputs (see `ContinuousBatchingKVCacheManager.increment_cache_lengths`)."""
        row_offsets = self._checked(kv_cache_inputs, prev_model_inputs)
        not_empty = Buffer.scalar(False, DType.bool)
        updated = []
        for blocks, cache_lengths, lookup_table, _, *scales in kv_cache_inputs:
            device = cache_lengths.device
            offsets = row_offsets if row_offsets.device == device else row_offsets.to(device)
            (new_lengths,) = self._graph(DeviceRef.from_device(device)).execute(cache_lengths, offsets)
            updated.append((blocks, new_lengths, lookup_table, not_empty, *scales))
        return updated

    def _checked(self, kv_cache_inputs: Sequence[CacheInputs], prev_model_inputs: Any) -> Buffer:
        """The arguments checked whole; returns the row offsets."""
        check_sequence("kv_cache_inputs", kv_cache_inputs)
        num_devices = len(self.buffer.graph_values)
        if len(kv_cache_inputs) != num_devices:
            raise ValueError(
                f"kv_cache_inputs has {len(kv_cache_inputs)} entries, one per device expected ({num_devices})"
            )
        batch_sizes = set()
        lengths = []
        names = ["blocks", "cache_lengths", "lookup_table", "is_cache_empty"]
        if self.buffer.scales:
            names.append("scales")
        for i, entry in enumerate(kv_cache_inputs):
            if not isinstance(entry, (tuple, list)) or len(entry) != len(names):
                raise TypeError(f"kv_cache_inputs[{i}] must be ({', '.join(names)}), got {entry!r}")
            blocks, cache_lengths, _, _, *scales = entry
            if blocks is not self.buffer.graph_values[i]:
                raise ValueError(f"kv_cache_inputs[{i}] holds a slot tensor that is not this manager's device {i}")
            if scales and scales[0] is not self.buffer.shard_scales[i]:
                raise ValueError(f"kv_cache_inputs[{i}] holds a scales tensor that is not this manager's device {i}")
            check_vector(f"kv_cache_inputs[{i}] cache_lengths", cache_lengths)
            batch_sizes.add(cache_lengths.shape[0])
            lengths.append(cache_lengths)
        if len(batch_sizes) > 1:
            raise ValueError(f"kv_cache_inputs have different batch sizes: {sorted(batch_sizes)}")
        if hasattr(prev_model_inputs, "input_row_offsets"):
            row_offsets = prev_model_inputs.input_row_offsets
        elif isinstance(prev_model_inputs, (tuple, list)) and len(prev_model_inputs) >= 2:
            row_offsets = prev_model_inputs[1]
        else:
            raise TypeError(
                "prev_model_inputs must have input_row_offsets or be a tuple (tokens, input_row_offsets, ...), "
                f"got {type(prev_model_inputs).__name__}"
            )
        check_vector("input_row_offsets", row_offsets)
        (batch,) = batch_sizes or {0}
        if row_offsets.shape[0] != batch + 1:
            raise ValueError(f"input_row_offsets has {row_offsets.shape[0]} entries, the batch needs {batch + 1}")
        offsets = host_numpy(row_offsets).astype(np.int64)
        new_tokens = np.diff(offsets)
        if (new_tokens < 0).any():
            raise ValueError(f"input_row_offsets must not decrease, got {offsets.tolist()}")
        for i, cache_lengths in enumerate(lengths):
            after = host_numpy(cache_lengths).astype(np.int64) + new_tokens
            if after.max(initial=0) > self.max_seq_len:
                raise ValueError(
                    f"kv_cache_inputs[{i}]: cache lengths would reach {int(after.max())}, "
                    f"past max_seq_len={self.max_seq_len}"
                )
        return row_offsets

    def _graph(self, device: DeviceRef) -> Model:
        """`cache_lengths + diff(input_row_offsets)` on `device`, where that
        device's cache lengths live; compiled once per device."""
        if device not in self._models:
            with Graph(
                "mokv_increment_cache_lengths",
                input_types=[
                    TensorType(DType.uint32, ["batch_size"], device),
                    TensorType(DType.uint32, ["batch_size_plus_one"], device),
                ],
            ) as graph:
                lengths, offsets = (v.tensor for v in graph.inputs)
                new_tokens = offsets[1:] - offsets[:-1]
                graph.output(lengths + ops.rebind(new_tokens, lengths.shape))
            self._models[device] = self.session.load(graph)
        return self._models[device]


def check_vector(name: str, value: object) -> None:
    """Refuses anything but a 1-D uint32 `Buffer`."""
    if not isinstance(value, Buffer) or value.dtype != DType.uint32 or value.rank != 1:
        described = (
            f"{value.dtype} with shape {tuple(value.shape)}" if isinstance(value, Buffer) else type(value).__name__
        )
        raise TypeError(f"{name} must be a 1-D uint32 max.driver.Buffer, got {described}")


def host_numpy(buffer: Buffer) -> np.ndarray:
    return buffer.to_numpy() if buffer.device.is_host else buffer.to(CPU()).to_numpy()
