"""MAX 26.7's own paged flash attention (`max.nn.kernels.flash_attention_ragged`),
driven directly from numpy-built cache inputs.

The independent reference that mokv's attention op is tested and benchmarked
against. Its block tensor layout `[pages, 2, layers, page_size, n_kv_heads,
head_dim]` is mokv's paged layout, so the very same buffers feed both kernels;
only MAX's extra per-batch scalars (page stride, max lengths, dispatch
metadata) and its padded lookup table are added here.

MAX's kernel specialises on the page size, head counts and head size: with any
of them symbolic the graph still compiles, but the CPU kernel then returns zeros
or garbage. So those are fixed per compiled graph (~2-3 minutes each on a
2-core CPU), as are the scale and the (causal) mask; batch, page count, token
counts and lookup-table width stay symbolic.

On a GPU the cache tensors, queries and offsets live on the device and the
per-batch scalars on the host, as MAX's own manager lays them out; a decode
batch gets the split count MAX's manager would give its flash-decoding kernel
(`mha_decode_num_partitions`).
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np
from max._kv_cache_ops import mha_decode_num_partitions
from max.driver import CPU, Buffer, Device
from max.dtype import DType
from max.engine import InferenceSession, Model
from max.graph import BufferType, DeviceRef, Graph, TensorType
from max.nn.attention.mask_config import MHAMaskVariant
from max.nn.kernels import flash_attention_ragged
from max.nn.kv_cache import KVCacheInputsPerDevice
from max.nn.kv_cache.cache_params import PACKED_PAGE_STRIDE
from max.nn.kv_cache.utils import MHAAttnKey, padded_lut_cols


@dataclass(frozen=True)
class MaxAttentionShape:
    """What MAX's kernel is compiled for."""

    dtype: DType
    num_layers: int
    n_q_heads: int
    n_kv_heads: int
    head_dim: int
    page_size: int
    scale: float


def build_graph(shape: MaxAttentionShape, device: DeviceRef | None = None) -> Graph:
    """A graph `(kv cache inputs..., q, input_row_offsets, layer_idx) -> out`
    running MAX's causal flash attention over its paged cache on `device`
    (the CPU unless given)."""
    cpu = DeviceRef.CPU()
    device = device or cpu
    dtype = shape.dtype
    input_types = [
        BufferType(
            dtype,
            ["total_num_pages", 2, shape.num_layers, shape.page_size, shape.n_kv_heads, shape.head_dim],
            device,
        ),
        TensorType(DType.int64, [1], cpu),  # page stride
        TensorType(DType.uint32, ["batch_size"], device),  # cache lengths
        TensorType(DType.uint32, ["batch_size", "lut_width"], device),
        TensorType(DType.uint32, [1], cpu),  # max prompt length
        TensorType(DType.uint32, [1], cpu),  # max cache length
        MHAAttnKey.dispatch_metadata_spec().tensor_type(device),
        TensorType(dtype, ["total_new_tokens", shape.n_q_heads, shape.head_dim], device),
        TensorType(DType.uint32, ["batch_plus_one"], device),
        TensorType(DType.uint32, [], cpu),
    ]
    name = "max_attention_" + "_".join(str(v).replace(".", "p") for v in vars(shape).values())
    if device != cpu:
        name += f"_{device.device_type}"
    with Graph(name, input_types=input_types) as graph:
        blocks, stride, lengths, lut, max_prompt, max_cache, dispatch, q, offsets, layer = graph.inputs
        cache = KVCacheInputsPerDevice(
            kv_blocks=blocks.buffer,
            page_stride=stride.tensor,
            cache_lengths=lengths.tensor,
            lookup_table=lut.tensor,
            max_prompt_length=max_prompt.tensor,
            max_cache_length=max_cache.tensor,
            attention_dispatch_metadata=dispatch.tensor,
        )
        # `flash_attention_ragged` reads only `dtype` from its KVCacheParams.
        out = flash_attention_ragged(
            SimpleNamespace(dtype=dtype),
            q.tensor,
            offsets.tensor,
            cache,
            layer.tensor,
            MHAMaskVariant.CAUSAL_MASK,
            shape.scale,
        )
        graph.output(out)
    return graph


@dataclass
class MaxPagedAttention:
    """MAX's paged attention, compiled for one `MaxAttentionShape` on `device`."""

    shape: MaxAttentionShape
    model: Model
    device: Device

    @classmethod
    def compile(
        cls, session: InferenceSession, shape: MaxAttentionShape, device: Device | None = None
    ) -> MaxPagedAttention:
        device = device or CPU()
        return cls(shape, session.load(build_graph(shape, DeviceRef.from_device(device))), device)

    def inputs(
        self,
        blocks: Buffer,
        cache_lengths: np.ndarray,
        lookup_table: np.ndarray,
        row_offsets: np.ndarray,
        q: Buffer,
        layer: int,
    ) -> list[Buffer]:
        """The graph's inputs for one batch (built once, so timing covers only
        `execute`). `blocks` and `q` are passed through as they are (on the
        kernel's device); the lookup table is widened to the padded width MAX's
        kernels expect, pointing the padding at the last block (the null page)."""
        batch = len(cache_lengths)
        new_tokens = np.diff(row_offsets.astype(np.int64))
        max_prompt = int(new_tokens.max(initial=0))
        max_context = int((cache_lengths.astype(np.int64) + new_tokens).max(initial=0))
        lut = np.full((batch, padded_lut_cols(lookup_table.shape[1])), blocks.shape[0] - 1, np.uint32)
        lut[:, : lookup_table.shape[1]] = lookup_table
        # num_partitions steers MAX's GPU decode kernel; 1 is what MAX's own
        # manager passes on a CPU-only host or for a batch with prefill rows.
        partitions = 1
        if not self.device.is_host and max_prompt == 1:
            partitions = mha_decode_num_partitions(batch, max_context, self.shape.n_kv_heads, self.device)
        dispatch = np.zeros(MHAAttnKey.dispatch_metadata_spec().shape, np.int64)
        MHAAttnKey(batch_size=batch, max_prompt_length=max_prompt, num_partitions=partitions).pack_into(
            dispatch, max_context
        )

        def on_device(array: np.ndarray) -> Buffer:
            host = Buffer.from_numpy(np.ascontiguousarray(array))
            return host if self.device.is_host else host.to(self.device)

        return [
            blocks,
            Buffer.from_numpy(np.array([PACKED_PAGE_STRIDE], np.int64)),
            on_device(cache_lengths.astype(np.uint32)),
            on_device(lut),
            Buffer.from_numpy(np.array([max_prompt], np.uint32)),
            Buffer.from_numpy(np.array([max_context], np.uint32)),
            Buffer.from_numpy(dispatch),
            q,
            on_device(row_offsets.astype(np.uint32)),
            Buffer.from_numpy(np.array(layer, np.uint32)),
        ]

    def __call__(self, inputs: list[Buffer]) -> Buffer:
        (out,) = self.model.execute(*inputs)
        return out
