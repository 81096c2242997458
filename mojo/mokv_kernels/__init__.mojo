"""Mojo kernels of mokv: KV cache layouts and the custom ops that use them.

- `cache`: the cache trait, the two layouts, the cache and collection
  structs, the batch summary;
- `pointers`: the raw-pointer aliases (shared with `mokv_weights`);
- `bind`: graph tensors to caches, with the bounds checks;
- `store`: the store and gather ops;
- `attention`: the attention op and its CPU kernels; `gpu`: the GPU kernels
  the ops launch on a GPU target;
- `opaque_collection`: the opaque continuous-batching collection and its ops;
- `kv_quantization`: 8-bit KV codes and their scales;
- `parallel`: the CPU kernels' fork-join (shared with `mokv_weights`).
"""
