"""KV cache parameters: the one description of a cache's shape and policy.

Everything downstream (buffers, page pools, managers, graph input types) reads
its sizes from a `KVCacheParams` (one cache, `cache_params`) or a
`MultiKVCacheParams` (several caches sharing one page table, such as a target
and a draft model: `multi`), so validation happens here, once, with errors
that name the offending value. MAX's own parameter objects are converted by
`from_max` (`max_conversion`), which refuses what mokv does not support.

A cache is quantized when `KVCacheParams.kvcache_quant_config` is set (MAX's
convention, `quantization`): `dtype` is then the *stored* 8-bit dtype
(`QUANTIZED_DTYPES`) and a float32 scales tensor sits beside the values
(`scales_shape`), one scale per `scale_block_shape` block of tokens x head_dim
elements.
"""

from .cache_params import SINGLE_CACHE, KVCacheParams, KVCacheStrategy
from .max_conversion import from_max, resolve_params
from .multi import AnyKVCacheParams, MultiKVCacheParams
from .quantization import QUANTIZED_DTYPES, SCALE_DTYPES, KVCacheQuantConfig, graph_dtype

__all__ = [
    "QUANTIZED_DTYPES",
    "SCALE_DTYPES",
    "SINGLE_CACHE",
    "AnyKVCacheParams",
    "KVCacheParams",
    "KVCacheQuantConfig",
    "KVCacheStrategy",
    "MultiKVCacheParams",
    "from_max",
    "graph_dtype",
    "resolve_params",
]
