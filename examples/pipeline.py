"""SmolLM2 on mokv's paged cache: the model graph, the manager and the scheduler
wired together, so the CLI commands and the tests drive one thing."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt
from max.driver import CPU, Buffer, Device
from max.dtype import DType
from max.engine import InferenceSession, Model
from max.graph import DeviceRef

from mokv import KVCacheInputs, KVCacheParams, PagedKVCacheManager
from mokv.connectors import KVConnectorConfig
from mokv_examples.scheduler import Request, Sampler, Scheduler, StepStats
from mokv_graphs.gguf_model import LlamaCheckpoint, load_llama
from mokv_graphs.llama import load_llama_model
from mokv_graphs.paged_attention import PagedCacheAttention
from mokv_graphs.tokenizer import GGUFTokenizer, load_tokenizer


@dataclass
class Completion:
    """One request's outcome."""

    prompt: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    preemptions: int


@dataclass
class GenerationReport:
    """A run's completions and statistics."""

    completions: list[Completion]
    stats: StepStats
    prefix_hit_rate: float
    wall_seconds: float

    def summary(self) -> dict[str, float]:
        s = self.stats
        return {
            "requests": len(self.completions),
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


class SmolLM2:
    """The compiled SmolLM2 graph over a paged cache, weights and cache on
    `device` (the CPU unless given). The graph leaves the page size symbolic,
    so one compiled model serves caches of any page size."""

    model_id = "SmolLM2-135M-Instruct.Q4_1.gguf/float32-graph"
    """Names the weights and graph numerics the KV comes from: shared cache
    tiers keep it apart from any other model's KV."""

    def __init__(
        self,
        session: InferenceSession | None = None,
        log: Callable[[str], None] | None = None,
        device: Device | None = None,
    ) -> None:
        log = log or (lambda msg: print(msg, file=sys.stderr))
        self.device = device or CPU()
        self.device_ref = DeviceRef.from_device(self.device)
        self.session = session or InferenceSession(devices=[CPU()] if self.device.is_host else [CPU(), self.device])
        started = time.perf_counter()
        self.checkpoint: LlamaCheckpoint = load_llama()
        self.tokenizer: GGUFTokenizer = load_tokenizer()
        log(
            f"loaded SmolLM2 weights and tokenizer in {time.perf_counter() - started:.1f} s; compiling the graph "
            "(minutes the first time, then loaded from the compile cache)..."
        )
        started = time.perf_counter()
        attention = PagedCacheAttention(self.cache_params(), self.device_ref)
        self.model: Model = load_llama_model(self.session, self.checkpoint, attention, self.device_ref)
        log(f"graph ready in {time.perf_counter() - started:.1f} s")

    def cache_params(self, page_size: int = 16, enable_prefix_caching: bool = False) -> KVCacheParams:
        """The model's cache geometry (the graph only reads the shape: its page
        size is symbolic) with this run's page size and prefix caching."""
        c = self.checkpoint.config
        return KVCacheParams(
            dtype=DType.float32,
            n_kv_heads=c.n_kv_heads,
            head_dim=c.head_dim,
            num_layers=c.n_layers,
            page_size=page_size,
            enable_prefix_caching=enable_prefix_caching,
            devices=[self.device_ref],
        )

    def step(
        self,
        tokens: npt.NDArray[np.int64],
        row_offsets: npt.NDArray[np.uint32],
        positions: npt.NDArray[np.int64],
        cache: KVCacheInputs,
    ) -> npt.NDArray[np.float32]:
        """One ragged step: stores the tokens' K/V and returns last-token logits."""
        inputs = [Buffer.from_numpy(a) for a in (tokens, row_offsets, positions)]
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
        prefix-cached blocks, so none without prefix caching)."""
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


def generate(
    model: SmolLM2,
    prompt_token_ids: Sequence[npt.NDArray[np.int64]],
    config: GenerationConfig,
    on_token: Callable[[Request, int], None] | None = None,
    on_step: Callable[[Scheduler], None] | None = None,
    manager: PagedKVCacheManager | None = None,
) -> tuple[list[Request], StepStats, PagedKVCacheManager]:
    """Runs every prompt to completion with continuous batching, on `manager`
    if given (a chat keeps one across turns so its history stays cached)."""
    manager = manager or make_manager(model, config)
    scheduler = Scheduler(
        manager,
        model.step,
        token_budget=config.token_budget,
        max_batch_size=config.max_batch_size,
        sampler=Sampler(config.temperature, config.seed),
        stop_token_ids=model.tokenizer.stop_token_ids,
    )
    requests = [
        Request(f"req-{i}", ids, config.max_new_tokens, cache_salt=config.cache_salt)
        for i, ids in enumerate(prompt_token_ids)
    ]
    for request in requests:
        scheduler.add(request)
    stats = scheduler.run(on_token, on_step)
    return requests, stats, manager


def make_manager(model: SmolLM2, config: GenerationConfig, max_batch_size: int | None = None) -> PagedKVCacheManager:
    """The paged cache `config` asks for, with its disk and remote tiers; call
    `shutdown()` on it when done so their background writes finish."""
    params = model.cache_params(config.page_size, config.enable_prefix_caching)
    return PagedKVCacheManager(
        params,
        model.session,
        config.num_pages,
        config.host_pages if config.enable_prefix_caching else 0,
        max_batch_size=max_batch_size or config.max_batch_size,
        connector_config=config.connector_config(model.model_id),
    )


def run_prompts(
    model: SmolLM2,
    prompts: Sequence[str],
    config: GenerationConfig,
    chat: bool = True,
    on_token: Callable[[Request, int], None] | None = None,
) -> GenerationReport:
    """Tokenizes, generates and decodes: the whole `mokv generate` job."""
    ids = [model.encode(p, chat) for p in prompts]
    started = time.perf_counter()
    requests, stats, manager = generate(model, ids, config, on_token)
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
        )
        for p, r in zip(prompts, requests, strict=True)
    ]
    return GenerationReport(completions, stats, metrics.cache_hit_rate, wall)
