"""The KV cache of one layer (key or value side), behind one trait.

Both layouts store tokens as rows of `[n_kv_heads, head_dim]` inside one page
tensor (the graph contract's `blocks`, MAX's `kv_blocks`) `[num_pages, 2, num_layers,
page_len, n_kv_heads, head_dim]` (index 0 of dim 1 holds keys, 1 holds values):

- paged (`PagedLayout`): a page holds `page_size` tokens; the lookup table
  `[batch, max_pages_per_seq]` maps (row, token // page_size) to a page;
- continuous batching (`ContinuousLayout`): each page is one sequence's slot
  of `max_seq_len` tokens; the lookup table `[batch]` maps a batch row to its
  slot.

A quantized cache (`float8_e4m3fn` or `int8` pages, `kv_quantization`) keeps
float32 scales beside the pages, `[num_pages, 2, num_layers, page_len //
tokens_per_scale, n_kv_heads, granules]`: one per granule of
`head_dim // granules` elements of one head of `tokens_per_scale` tokens
(`ScaleTable`). Every cache answers `scale_row`; an unquantized one has none.

Kernels are written against `KVCacheT` only, so both layouts share them. The
layout is a type parameter of one cache struct (`KVCache`) and one collection
struct (`KVCacheCollection`), with MAX's names as aliases (`PagedKVCache`,
`ContinuousBatchingKVCacheCollection`, ...): an op can then choose the layout
at compile time and still hand the kernels a cache whose dtype is its own.

The package, one concept per module: `traits` (`KVCacheT`, `KVCollectionT`),
`layout` (the page tensor's geometry, the scale table, the two layouts),
`kv_cache` (`KVCache`), `collection` (`KVCacheCollection`) and
`batch_summary` (`BatchSummary`). The pointer aliases are in
`mokv_kernels.pointers`.
"""
