"""SmolLM2 on a paged KV cache: the model graph, the manager and the scheduler
wired together, so the CLI commands and the tests drive one thing.

The cache is a `CacheBackend`: mokv's own (`MokvCache`, the default), or, for
side-by-side benchmarks and tests, MAX's (`mokv_reference.max_cache.MaxCache`),
each bringing its graph's attention backend, its manager and its contexts."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import numpy.typing as npt
from max.driver import CPU, Buffer, Device
from max.dtype import DType
from max.engine import InferenceSession, Model
from max.graph import DeviceRef, Graph

from mokv import KVCacheParams, KVCacheQuantConfig, PagedKVCacheManager
from mokv.graph import GraphGroup
from mokv.tiers import KVConnectorConfig
from mokv_examples.progress import ticking
from mokv_examples.scheduler import (
    CacheInputs,
    CacheManager,
    ModelStep,
    Request,
    RequestContext,
    Sampler,
    Scheduler,
    StepStats,
    mokv_context,
)
from mokv_models.attention_backends import AttentionBackend
from mokv_models.gguf_model import LlamaCheckpoint, LlamaConfig, load_llama
from mokv_models.llama import build_llama_graph, last_token_rows, llama_weights_registry
from mokv_models.paged_attention import PagedCacheAttention
from mokv_models.tokenizer import GGUFTokenizer, load_tokenizer
from mokv_models.weight_formats import WEIGHT_FORMATS

CPU_REF = DeviceRef.CPU()

KV_DTYPES = ("float32", "bfloat16", "float8_e4m3fn", "int8")
"""How the pipeline can store its KV: plain float32 or bfloat16, or 8-bit
codes with a float32 scale per token and KV head, keys Hadamard-rotated
unless asked otherwise (`KVCacheQuantConfig.rotate_keys`)."""


def kv_storage(kv_dtype: str, rotate_keys: bool = True) -> dict[str, object]:
    """`KVCacheParams` fields (`dtype`, `kvcache_quant_config`) for a `KV_DTYPES` name;
    `rotate_keys` applies to the 8-bit formats."""
    if kv_dtype not in KV_DTYPES:
        raise ValueError(f"kv_dtype must be one of {', '.join(KV_DTYPES)}, got {kv_dtype!r}")
    quantized = kv_dtype in ("float8_e4m3fn", "int8")
    config = KVCacheQuantConfig(rotate_keys=rotate_keys) if quantized else None
    return {"dtype": DType[kv_dtype], "kvcache_quant_config": config}


class CacheBackend(Protocol):
    """Where a pipeline keeps its KV cache."""

    name: str

    def attention(self, params: KVCacheParams) -> AttentionBackend:
        """The graph's attention over this cache, for the cache geometry `params`
        (on `params.devices[0]`)."""
        ...

    def manager(
        self,
        params: KVCacheParams,
        session: InferenceSession,
        num_pages: int,
        max_batch_size: int,
        host_pages: int = 0,
        connectors: KVConnectorConfig | None = None,
    ) -> CacheManager:
        """A manager of `num_pages` pages with `params`' page size and prefix
        caching, and the KV tiers below the device asked for."""
        ...

    def context(self, request_id: str, tokens: npt.NDArray[np.int64], cache_salt: str | None = None) -> RequestContext:
        """A new request's context, of the kind this cache's manager reads."""
        ...


class MokvCache:
    """mokv's paged cache: `PagedKVCacheManager` and mokv's store and flash attention
    kernels. The graph leaves the page size symbolic, so one compiled model serves
    managers of every page size."""

    name = "mokv"

    def attention(self, params: KVCacheParams) -> AttentionBackend:
        return PagedCacheAttention(params, params.devices[0])

    def manager(
        self,
        params: KVCacheParams,
        session: InferenceSession,
        num_pages: int,
        max_batch_size: int,
        host_pages: int = 0,
        connectors: KVConnectorConfig | None = None,
    ) -> CacheManager:
        return PagedKVCacheManager(
            params, session, num_pages, host_pages, max_batch_size=max_batch_size, connector_config=connectors
        )

    def context(self, request_id: str, tokens: npt.NDArray[np.int64], cache_salt: str | None = None) -> RequestContext:
        return mokv_context(request_id, tokens, cache_salt)


@dataclass
class Completion:
    """One request's outcome."""

    prompt: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    preemptions: int
    time_to_first_token: float
    logprobs: list[dict] | None = None


@dataclass
class GenerationReport:
    """A run's completions and statistics."""

    completions: list[Completion]
    stats: StepStats
    prefix_hit_rate: float
    wall_seconds: float

    def summary(self) -> dict[str, float]:
        s = self.stats
        first_tokens = [c.time_to_first_token for c in self.completions]
        return {
            "requests": len(self.completions),
            "time_to_first_token_s": float(np.mean(first_tokens)) if first_tokens else 0.0,
            "max_time_to_first_token_s": max(first_tokens, default=0.0),
            "prefill_tokens": s.prefill_tokens,
            "decode_tokens": s.decode_tokens,
            "prefill_tokens_per_s": s.prefill_tokens_per_s,
            "decode_tokens_per_s": s.decode_tokens_per_s,
            "steps": s.steps,
            "preemptions": s.preemptions,
            "peak_pages_used": s.peak_pages_used,
            "prefix_hit_rate": self.prefix_hit_rate,
            "wall_seconds": self.wall_seconds,
        }


def cache_geometry(
    config: LlamaConfig,
    kv_dtype: str = KV_DTYPES[0],
    rotate_keys: bool = True,
    device_ref: DeviceRef = CPU_REF,
    page_size: int = 16,
    enable_prefix_caching: bool = False,
) -> KVCacheParams:
    """The cache parameters of a model of `config` storing its KV as `kv_dtype` on
    `device_ref` (its graph reads only the shape: the page size stays symbolic)."""
    return KVCacheParams(
        **kv_storage(kv_dtype, rotate_keys),  # type: ignore[arg-type]
        n_kv_heads=config.n_kv_heads,
        head_dim=config.head_dim,
        num_layers=config.n_layers,
        page_size=page_size,
        enable_prefix_caching=enable_prefix_caching,
        devices=[device_ref],
    )


def pipeline_graph_name(
    weights: str, cache: CacheBackend, kv_dtype: str, rotate_keys: bool = True, device_ref: DeviceRef = CPU_REF
) -> str:
    """The name of `pipeline_graph`'s graph: what it was built from, so a model compiled
    for other arguments is never taken for it."""
    rotation = "" if rotate_keys or kv_dtype not in ("float8_e4m3fn", "int8") else "_unrotated"
    return f"smollm2_{weights}_on_{cache.name}_{kv_dtype}{rotation}_{device_ref.device_type}"


def pipeline_graph(
    checkpoint: LlamaCheckpoint,
    cache: CacheBackend,
    kv_dtype: str = KV_DTYPES[0],
    rotate_keys: bool = True,
    device_ref: DeviceRef = CPU_REF,
    group: GraphGroup | None = None,
) -> Graph:
    """The graph a `SmolLM2` pipeline with these arguments runs, built into `group` when
    given (to compile it with other graphs; then hand the loaded models to `SmolLM2`)."""
    attention = cache.attention(cache_geometry(checkpoint.config, kv_dtype, rotate_keys, device_ref))
    name = pipeline_graph_name(checkpoint.weight_format, cache, kv_dtype, rotate_keys, device_ref)
    return build_llama_graph(checkpoint.config, attention, checkpoint.encodings, name, device_ref, group)


@dataclass(frozen=True)
class CompiledGraphs:
    """Graphs compiled together (`GraphGroup.load`) over one checkpoint's weights, by graph
    name. The checkpoint's arrays back the models (MAX aliases them on the CPU), so it
    travels with them."""

    checkpoint: LlamaCheckpoint
    models: Mapping[str, Model]

    def model(self, name: str, weight_format: str) -> Model:
        """The model of graph `name`, which must run `weight_format` weights."""
        if weight_format != self.checkpoint.weight_format:
            raise ValueError(f"weights {weight_format!r}: the compiled graphs run {self.checkpoint.weight_format!r}")
        if name not in self.models:
            raise KeyError(f"no compiled graph {name!r} among {sorted(self.models)}: build it with pipeline_graph")
        return self.models[name]


class SmolLM2:
    """The compiled SmolLM2 graph over a paged cache (`cache`, mokv's by default),
    with its weights in format `weights` (`mokv_models.weight_formats`), its KV
    stored as `kv_dtype` (`KV_DTYPES`; 8-bit keys Hadamard-rotated unless
    `rotate_keys` is False), weights and cache on `device` (the CPU unless
    given).

    It compiles its graph unless `compiled` holds it: `pipeline_graph` of the same
    arguments built into a `GraphGroup` beside other graphs, so that they compile
    together (a test session's pipelines and their dense references)."""

    def __init__(
        self,
        session: InferenceSession | None = None,
        log: Callable[[str], None] | None = None,
        weights: str = WEIGHT_FORMATS[0],
        cache: CacheBackend | None = None,
        device: Device | None = None,
        kv_dtype: str = KV_DTYPES[0],
        rotate_keys: bool = True,
        compiled: CompiledGraphs | None = None,
    ) -> None:
        self.kv_dtype = kv_dtype
        self.rotate_keys = rotate_keys
        kv_storage(kv_dtype, rotate_keys)  # a bad kv_dtype raises before the checkpoint loads
        log = log or (lambda msg: print(msg, file=sys.stderr))
        self.device = device or CPU()
        self.device_ref = DeviceRef.from_device(self.device)
        if not self.device.is_host and weights != "f32":
            raise ValueError(f"weights {weights!r}: the block-format weight kernels run on the CPU; use 'f32' on a GPU")
        self.session = session or InferenceSession(devices=[CPU()] if self.device.is_host else [CPU(), self.device])
        self.cache = cache or MokvCache()
        if compiled is None:
            compiled = self._compile_alone(weights, kv_dtype, rotate_keys, log)
        name = pipeline_graph_name(weights, self.cache, kv_dtype, rotate_keys, self.device_ref)
        self.model: Model = compiled.model(name, weights)
        self.checkpoint: LlamaCheckpoint = compiled.checkpoint
        self.tokenizer: GGUFTokenizer = load_tokenizer()

    def _compile_alone(
        self, weights: str, kv_dtype: str, rotate_keys: bool, log: Callable[[str], None]
    ) -> CompiledGraphs:
        """This pipeline's graph compiled as a group of one: the same path as graphs
        compiled together, so the tests of those cover it."""
        started = time.perf_counter()
        checkpoint = load_llama(weights=weights, log=log)
        log(f"loaded SmolLM2's {weights} weights in {time.perf_counter() - started:.1f} s")
        label = f"compiling the graph on {self.cache.name}'s {kv_dtype} cache (minutes the first time, then cached)"
        with ticking(label, log):
            group = GraphGroup()
            pipeline_graph(checkpoint, self.cache, kv_dtype, rotate_keys, self.device_ref, group)
            return CompiledGraphs(checkpoint, group.load(self.session, llama_weights_registry(checkpoint)))

    @property
    def weight_format(self) -> str:
        return self.checkpoint.weight_format

    @property
    def model_id(self) -> str:
        """Names the weights, graph numerics and KV storage the cached KV comes
        from: shared cache tiers keep it apart from any other model's KV, and
        from this model's under another weight format or KV dtype."""
        return f"SmolLM2-135M-Instruct.Q4_1.gguf/{self.weight_format}-weights/float32-activations/{self.kv_dtype}-kv"

    def new_manager(self, config: GenerationConfig, max_batch_size: int | None = None) -> CacheManager:
        """A fresh cache manager for `config`'s page size, pages, prefix caching
        and KV tiers; call `shutdown()` on it when done so the tiers'
        background writes finish."""
        params = self.cache_params(config.page_size, config.enable_prefix_caching)
        return self.cache.manager(
            params,
            self.session,
            config.num_pages,
            max_batch_size or config.max_batch_size,
            config.host_pages if config.enable_prefix_caching else 0,
            config.connector_config(self.model_id),
        )

    def cache_params(self, page_size: int = 16, enable_prefix_caching: bool = False) -> KVCacheParams:
        """The model's cache geometry (the graph only reads the shape: its page
        size is symbolic) with this run's page size and prefix caching."""
        return cache_geometry(
            self.checkpoint.config, self.kv_dtype, self.rotate_keys, self.device_ref, page_size, enable_prefix_caching
        )

    def step(
        self,
        tokens: npt.NDArray[np.int64],
        row_offsets: npt.NDArray[np.uint32],
        positions: npt.NDArray[np.int64],
        cache: CacheInputs,
        logit_rows: npt.NDArray[np.int64] | None = None,
    ) -> npt.NDArray[np.float32]:
        """One ragged step: stores the tokens' K/V and returns the logits of `logit_rows`
        (default: each sequence's last token)."""
        rows = last_token_rows(row_offsets) if logit_rows is None else logit_rows
        inputs = [Buffer.from_numpy(a) for a in (tokens, row_offsets, positions, rows)]
        if not self.device.is_host:
            inputs = [buffer.to(self.device) for buffer in inputs]
        (logits,) = self.model.execute(*inputs, *cache.flatten())
        return logits.to_numpy()

    def encode(self, prompt: str, chat: bool) -> npt.NDArray[np.int64]:
        if chat:
            return self.tokenizer.encode_chat([{"role": "user", "content": prompt}])
        return self.tokenizer.encode(prompt)


@dataclass
class GenerationConfig:
    """How one `generate` run uses the cache and the scheduler."""

    max_new_tokens: int = 64
    temperature: float = 0.0
    seed: int = 0
    page_size: int = 16
    num_pages: int = 512
    enable_prefix_caching: bool = True
    max_batch_size: int = 16
    token_budget: int = 512
    host_pages: int = 0
    """Pages of the host-memory KV tier (0: none)."""
    cache_salt: str | None = None
    """Every request's cache salt: cached KV is shared only with the same salt."""
    disk_cache: str | None = None
    """Directory of the disk KV tier (shared by processes, kept across runs)."""
    disk_gb: float | None = None
    """Byte budget of the disk tier (None: twice the device pool)."""
    remote_cache: str | None = field(default=None, repr=False)
    """`redis://` URL of the remote KV tier; may hold a password, so it is
    kept out of `repr` and `report()`."""

    def connector_config(self, model_id: str) -> KVConnectorConfig | None:
        """The disk and remote tiers asked for, if any (they keep only
        prefix-cached pages, so none without prefix caching)."""
        if not self.enable_prefix_caching or (self.disk_cache is None and self.remote_cache is None):
            return None
        return KVConnectorConfig(
            model_id=model_id,
            disk_offload_dir=self.disk_cache,
            disk_offload_max_gb=self.disk_gb,
            remote_url=self.remote_cache,
        )

    def report(self) -> dict[str, object]:
        """The config for JSON reports, the remote URL without credentials."""
        out = dict(vars(self))
        if self.remote_cache is not None:
            out["remote_cache"] = KVConnectorConfig(remote_url=self.remote_cache).remote_where
        return out


def pages_to_hold(prompts: Sequence[npt.NDArray[np.int64]], new_tokens: int, page_size: int) -> int:
    """Pages that hold every prompt with its new tokens at once (no preemption)."""
    return sum(-(-(len(p) + new_tokens) // page_size) for p in prompts) + 1


def request_id(index: int) -> str:
    """The id of the `index`-th prompt of a `generate` call."""
    return f"req-{index}"


def generate(
    model: SmolLM2,
    prompt_token_ids: Sequence[npt.NDArray[np.int64]],
    config: GenerationConfig,
    on_token: Callable[[Request, int], None] | None = None,
    on_step: Callable[[Scheduler], None] | None = None,
    manager: CacheManager | None = None,
    logprobs: int = 0,
    step: ModelStep | None = None,
) -> tuple[list[Request], StepStats, CacheManager]:
    """Runs every prompt to completion with continuous batching, on `manager`
    if given (a chat keeps one across turns so its history stays cached), with
    `model.step` or a `step` that wraps it (a benchmark's timer)."""
    manager = manager or model.new_manager(config)
    scheduler = Scheduler(
        manager,
        step or model.step,
        token_budget=config.token_budget,
        max_batch_size=config.max_batch_size,
        sampler=Sampler(config.temperature, config.seed),
        stop_token_ids=model.tokenizer.stop_token_ids,
        new_context=model.cache.context,
        logprobs=logprobs,
    )
    requests = [
        Request(request_id(i), ids, config.max_new_tokens, cache_salt=config.cache_salt)
        for i, ids in enumerate(prompt_token_ids)
    ]
    for request in requests:
        scheduler.add(request)
    stats = scheduler.run(on_token, on_step)
    return requests, stats, manager


def run_prompts(
    model: SmolLM2,
    prompts: Sequence[str],
    config: GenerationConfig,
    chat: bool = True,
    on_token: Callable[[Request, int], None] | None = None,
    logprobs: int = 0,
) -> GenerationReport:
    """Tokenizes, generates and decodes: the whole `mokv generate` job."""
    ids = [model.encode(p, chat) for p in prompts]
    started = time.perf_counter()
    requests, stats, manager = generate(model, ids, config, on_token, logprobs=logprobs)
    wall = time.perf_counter() - started
    manager.shutdown()
    metrics = manager.get_metrics_aggregated()
    completions = [
        Completion(
            prompt=p,
            prompt_token_ids=r.prompt.tolist(),
            token_ids=list(r.generated),
            text=model.tokenizer.decode(r.generated, skip_special_tokens=True),
            preemptions=r.preemptions,
            time_to_first_token=r.time_to_first_token or 0.0,
            logprobs=[lp.as_json() for lp in r.logprobs] if logprobs else None,
        )
        for p, r in zip(prompts, requests, strict=True)
    ]
    return GenerationReport(completions, stats, metrics.cache_hit_rate, wall)
