"""MAX's Llama on mokv's cache, for `max generate` / `max serve --custom-architectures mokv.pipelines.architecture`.

MAX 26.7 imports the module given to `--custom-architectures` and registers
every entry of its `ARCHITECTURES` over the built-in one of the same name, so
`LlamaForCausalLM` checkpoints then run MAX's own Llama3 (its graph, weights
and encodings: float32, bfloat16, q4_0, q4_k, q6_k) with:

- every layer's attention its mokv twin (`mokv.pipelines.attention.to_mokv`:
  the same weights and names, mokv's `store_kv` / `attention` for the cache),
  and mokv's Mojo kernels (`mokv.kernels.kernel_package`) as the decoder
  graph's custom extension;
- a float8 cache (`--kv-cache-format float8_e4m3fn`) quantized with one float32
  scale per token and KV head (`MokvLlama3Config`), its blocks declared to the
  graph as their uint8 bits;
- mokv's manager, built from MAX's cache flags (`mokv.pipelines.cache_config`),
  in place of MAX's.

The manager is the one place without a hook: `TextGenerationPipeline.__init__`
builds its manager by calling `load_kv_manager`, a name imported into
`max.pipelines.lib.pipeline_variants.text_generation`. The architecture's
pipeline class (`MokvTextGenerationPipeline`, MAX's class with only its
constructor wrapped) rebinds that one module global to
`mokv.pipelines.scheduler_manager.create_kv_manager`
while its own `super().__init__` runs, and restores it after. Before patching
it checks that the name is MAX's `max.pipelines.kv_cache.load_kv_manager` with
the keyword parameters MAX passes; after, that MAX called it exactly once; a
mismatch raises `RuntimeError` naming the symbol and the signature expected,
so a MAX release that builds its manager differently fails at start rather
than running MAX's manager under mokv's kernels.

One device only: tensor- and data-parallel Llama graphs are refused.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from max.dtype import DType
from max.graph import BufferType
from max.nn.kv_cache import KVCacheQuantizationConfig
from max.pipelines.architectures.llama3 import Llama3Config, Llama3Model, llama_arch
from max.pipelines.context import TextContext
from max.pipelines.kv_cache import load_kv_manager
from max.pipelines.lib.graph_specs import GraphRole, GraphSpec
from max.pipelines.lib.pipeline_variants import text_generation
from max.pipelines.lib.pipeline_variants.text_generation import TextGenerationPipeline

from ..kernels import kernel_package
from ..params import graph_dtype
from .attention import to_mokv
from .cache_config import mokv_cache_config
from .scheduler_manager import create_kv_manager

PATCHED_SYMBOL = "max.pipelines.lib.pipeline_variants.text_generation.load_kv_manager"
"""The module global `MokvTextGenerationPipeline` rebinds while MAX's constructor runs."""

EXPECTED_PARAMETERS = (
    "params",
    "max_batch_size",
    "max_seq_len",
    "session",
    "available_cache_memory",
    "is_di_enabled",
    "model_name",
    "max_num_input_tokens",
)
"""The keyword arguments MAX 26.7's pipeline passes `load_kv_manager`."""


class MokvLlama3Config(Llama3Config):
    """MAX's Llama3 config; a float8 cache gets its scale config (one float32
    scale per token and KV head), which MAX's Llama leaves out."""

    @classmethod
    def construct_kv_params(cls, *args: Any, **kwargs: Any) -> Any:
        params = super().construct_kv_params(*args, **kwargs)
        if params.dtype == DType.float8_e4m3fn and params.kvcache_quant_config is None:
            scales = KVCacheQuantizationConfig(scale_dtype=DType.float32, quantization_granularity=params.head_dim)
            params = dataclasses.replace(params, kvcache_quant_config=scales)
        return params


def _graph_input_type(value: Any) -> Any:
    """A cache buffer as mokv's kernels take it in a graph (float8 as uint8 bits)."""
    if isinstance(value, BufferType) and graph_dtype(value.dtype) != value.dtype:
        return BufferType(graph_dtype(value.dtype), value.shape, value.device)
    return value


class MokvLlama3Model(Llama3Model):
    """MAX's Llama3 pipeline model with its attention on mokv's ops and kernels."""

    model_config_cls = MokvLlama3Config

    def _create_model_config(self, state_dict: dict[str, Any]) -> Any:
        """MAX's Llama3 config for the graph, holding the cache params the
        pipeline model declared (`MokvLlama3Config`'s), which MAX's config
        builds again without the float8 scales: the graph unflattens its cache
        inputs with these."""
        config = super()._create_model_config(state_dict)
        config.kv_params = self.kv_params
        return config

    def graph_specs(self, model_config: Any) -> dict[str, GraphSpec]:
        """MAX's decoder spec, its attention layers turned into mokv's twins,
        float8 blocks declared as uint8, and mokv's kernels added.

        Raises:
            ValueError: several devices or data-parallel replicas.
        """
        if len(self.devices) > 1 or model_config.data_parallel_degree > 1:
            raise ValueError(
                f"mokv's Llama runs on one device, got {len(self.devices)} devices and "
                f"data_parallel_degree={model_config.data_parallel_degree}"
            )
        specs = super().graph_specs(model_config)
        decoder = specs[GraphRole.DECODER]
        for block in decoder.module.layers:
            to_mokv(block.self_attn)
        specs[GraphRole.DECODER] = dataclasses.replace(
            decoder,
            input_types=[_graph_input_type(t) for t in decoder.input_types],
            custom_extensions=[*decoder.custom_extensions, kernel_package()],
        )
        return specs


def _check_patch_point() -> None:
    found = getattr(text_generation, "load_kv_manager", None)
    parameters = tuple(inspect.signature(found).parameters) if callable(found) else None
    if found is not load_kv_manager or parameters != EXPECTED_PARAMETERS:
        raise RuntimeError(
            f"mokv's pipeline replaces {PATCHED_SYMBOL}, expected to be max.pipelines.kv_cache.load_kv_manager"
            f"({', '.join(EXPECTED_PARAMETERS)}); this MAX has {found!r} with parameters {parameters}: "
            "mokv.pipelines.architecture does not support this MAX release"
        )


@contextmanager
def _mokv_kv_manager(model_path: str, kv_cache: Any) -> Iterator[list[Any]]:
    """Rebinds `PATCHED_SYMBOL` to build mokv's manager while the block runs;
    yields the list of managers built (MAX must build exactly one)."""
    _check_patch_point()
    built: list[Any] = []

    def build(*, params: Any, is_di_enabled: bool, model_name: str, **sizes: Any) -> Any:
        if is_di_enabled:
            raise ValueError("mokv's manager does not serve disaggregated inference (is_di_enabled)")
        built.append(create_kv_manager(params, mokv_cache_config(params, kv_cache, model_path), **sizes))
        return built[-1]

    text_generation.load_kv_manager = build
    try:
        yield built
    finally:
        text_generation.load_kv_manager = load_kv_manager
    if len(built) != 1:
        raise RuntimeError(
            f"MAX's TextGenerationPipeline.__init__ called {PATCHED_SYMBOL} {len(built)} times, mokv expects once: "
            "mokv.pipelines.architecture does not support this MAX release"
        )


class MokvTextGenerationPipeline(TextGenerationPipeline[TextContext]):
    """MAX's text-generation pipeline with mokv's manager (see the module docstring)."""

    def __init__(self, pipeline_config: Any, *args: Any, **kwargs: Any) -> None:
        model = pipeline_config.model
        with _mokv_kv_manager(str(model.model_path), model.kv_cache):
            super().__init__(pipeline_config, *args, **kwargs)


mokv_llama_arch = dataclasses.replace(
    llama_arch,
    pipeline_model=MokvLlama3Model,
    config=MokvLlama3Config,
    pipeline_cls=MokvTextGenerationPipeline,
    supports_overlap_scheduler=False,
    supports_device_graph_capture=False,
    cascade_pipeline_factory=None,  # MAX's experimental cascade server is not wired to mokv's manager
)
"""MAX's `LlamaForCausalLM` architecture on mokv's attention, kernels and manager."""

ARCHITECTURES = [mokv_llama_arch]
