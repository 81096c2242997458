"""mokv's per-batch cache inputs in the layout MAX's graphs consume.

MAX 26.7's Llama takes each device's cache as a `KVCacheInputsPerDevice` of
buffers, its fields filled exactly where MAX's params declare a graph input
(`MHAKVCacheParams.get_symbolic_inputs`). `max_device_inputs` builds that
object from one device's `mokv.PagedCacheInputs` (the contract:
`mokv.contract`), field by field:

- `kv_blocks`, `cache_lengths`, `lookup_table`: mokv's block tensor (float8
  as its uint8 bits, `mokv.params.graph_dtype`) and tables, as they are. The
  lookup table is as wide as the batch needs, null-padded with mokv's null
  page; MAX's own manager pads its width further for its kernels' SIMD
  reads, which mokv's kernels do not make.
- `max_prompt_length`, `max_cache_length`: row 0 of mokv's `max_lengths`, as
  two host `[1]` uint32 buffers.
- `page_stride` (and `scales_page_stride`): mokv's pages are packed, so
  MAX's packed sentinel, -1.
- An 8-bit cache: `kv_scales` is mokv's scales tensor (MAX's scale layout
  with one scale per token) and `scales_lookup_table` the same lookup table
  (mokv pages scales with values).
- `attention_dispatch_metadata`: what MAX's params resolve for the batch's
  shape (`resolve_attn_key`), because the graph declares it; mokv's
  attention plans from `max_lengths` and does not read it.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from max.driver import Buffer, Device
from max.nn.kv_cache import KVCacheInputsPerDevice, KVCacheParamInterface
from max.nn.kv_cache.cache_params import PACKED_PAGE_STRIDE

from ..contract import PagedCacheInputs

MaxDeviceInputs = KVCacheInputsPerDevice[Buffer, Buffer]
"""One device's cache inputs as MAX's graphs take them."""


def _packed_stride() -> Buffer:
    return Buffer.from_numpy(np.array([PACKED_PAGE_STRIDE], np.int64))


def max_device_inputs(
    params: KVCacheParamInterface,
    replica_inputs: Sequence[PagedCacheInputs[Buffer]],
    devices: Sequence[Device],
    batch_size: int,
) -> list[MaxDeviceInputs]:
    """One replica's inputs (one `PagedCacheInputs` per TP shard, on
    `devices`) as MAX's `KVCacheInputsPerDevice`, for a batch of
    `batch_size` rows (or the `BatchCharacteristics` batch size the tables
    were built for)."""
    first = replica_inputs[0]
    max_prompt, max_cache = (int(v) for v in first.max_lengths.to_numpy()[0])
    key = params.resolve_attn_key(batch_size, max_prompt, max_cache)
    metadata = key.dispatch_metadata_buffers(
        None, name="attention_dispatch_metadata", devices=list(devices), max_cache_valid_length=max_cache
    )
    prompt = Buffer.from_numpy(np.array([max_prompt], np.uint32))
    cache = Buffer.from_numpy(np.array([max_cache], np.uint32))
    out = []
    for shard, shard_metadata in zip(replica_inputs, metadata, strict=True):
        scaled = shard.scales is not None
        out.append(
            KVCacheInputsPerDevice(
                kv_blocks=shard.blocks,
                cache_lengths=shard.cache_lengths,
                lookup_table=shard.lookup_table,
                max_prompt_length=prompt,
                max_cache_length=cache,
                page_stride=_packed_stride(),
                kv_scales=shard.scales,
                scales_page_stride=_packed_stride() if scaled else None,
                scales_lookup_table=shard.lookup_table if scaled else None,
                attention_dispatch_metadata=shard_metadata,
            )
        )
    return out
