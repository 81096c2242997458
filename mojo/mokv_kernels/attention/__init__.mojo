"""Flash attention of a ragged batch over the cache (CPU).

Token i of batch row b sits at position `cache_lengths[b] + i` and attends to
positions `0 ..= cache_lengths[b] + i` of its own sequence (with a sliding
window W > 0, only the last W of them); its own key and value were stored
before the op runs. Query head h reads KV head `h // (n_q_heads // n_kv_heads)`.

The package, one concept per module:

- `config`: vector width, tile and register-block sizes, split thresholds;
- `scratch`: the float32 arena a work item carves its scratch from;
- `queries`: the step's ragged queries, their outputs and the attention
  parameters;
- `tiles`: walking a row's context tile by tile through the page table;
- `softmax`: the online softmax state, and merging the partial states of a
  context split over several items;
- `decode` and `prefill`: the two kinds of work item;
- `plan`: cutting a batch into work items;
- `op`: checking the inputs, running the plan, and the registered ops.

These are the CPU kernels; on a GPU target the ops launch `mokv_kernels.gpu`'s
(`attention_on`).
"""
