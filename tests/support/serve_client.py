"""What the `max serve` tests do through the official `openai` client, and what
they read back from the server's Prometheus metrics."""

from __future__ import annotations

import time
from dataclasses import dataclass

import openai

from mokv_examples.max_server import MaxServer

SYSTEM = (
    "You are a patient assistant for a team that runs a large inference service. Answer in short, "
    "plain sentences. The service keeps the keys and values of every attention layer for the tokens "
    "it has already processed, in fixed-size pages of memory, so that a conversation that comes back "
    "with a longer history only computes its new tokens. Pages that hold a complete prefix are shared "
    "by every request that starts with the same tokens, and they are evicted least recently used "
    "first when memory runs out. Requests from different tenants carry different cache salts and "
    "never share a page, even when their prompts are equal. When a page is evicted from device "
    "memory it may still be found in host memory, on a local disk or in a shared remote store. "
    "Operators watch three numbers: how long the first token of an answer takes, how many tokens "
    "the service produces per second, and which share of prompt tokens came from the cache. They "
    "size the page pool so that a full batch of the longest requests fits, keep a host tier about "
    "one and a half times as large, and let the shared store hold what every replica has computed. "
    "A client that goes away in the middle of an answer must leave nothing behind: its pages go "
    "back to the pool at once, and the prefix it computed stays reusable for the next request."
)
"""A system prompt longer than two 128-token pages, so conversations share whole pages."""


def client(server: MaxServer, **kwargs: object) -> openai.OpenAI:
    """An OpenAI client for `server` (no retries: a failure is the server's answer)."""
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=600, **kwargs)


@dataclass(frozen=True)
class CacheReading:
    """The server's prefix-cache counters at one moment (tokens, since start)."""

    device_hits: float
    external_hits: float
    misses: float
    used_pages: float
    total_pages: float

    def __sub__(self, other: CacheReading) -> CacheReading:
        return CacheReading(
            self.device_hits - other.device_hits,
            self.external_hits - other.external_hits,
            self.misses - other.misses,
            self.used_pages,
            self.total_pages,
        )

    @property
    def hits(self) -> float:
        return self.device_hits + self.external_hits


def cache_reading(server: MaxServer) -> CacheReading:
    """The counters after the server's last batch (MAX records them once per batch)."""
    m = server.metrics()
    return CacheReading(
        device_hits=m.value("maxserve_cache_hits_tokens_total", tier="g0"),
        external_hits=m.value("maxserve_cache_hits_tokens_total", tier="external"),
        misses=m.value("maxserve_cache_misses_tokens_total"),
        used_pages=m.value("maxserve_cache_num_used_blocks"),
        total_pages=m.value("maxserve_cache_num_total_blocks"),
    )


def settled_reading(server: MaxServer, timeout_s: float = 30.0) -> CacheReading:
    """`cache_reading` once two readings a second apart agree (the metrics
    process receives them asynchronously)."""
    deadline = time.monotonic() + timeout_s
    last = cache_reading(server)
    while time.monotonic() < deadline:
        time.sleep(1.0)
        now = cache_reading(server)
        if now == last:
            return now
        last = now
    return last


def ask(server: MaxServer, messages: list[dict[str, str]], *, max_tokens: int = 12, **kwargs: object):
    """A greedy chat completion of exactly `max_tokens` tokens (EOS ignored):
    the whole response object."""
    return client(server).chat.completions.create(
        model=server.model,
        messages=messages,
        max_tokens=max_tokens,
        temperature=0,
        extra_body={"ignore_eos": True},
        **kwargs,
    )
