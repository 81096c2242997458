"""What the `max serve` tests do through the official `openai` client, and what
they read back from the server's Prometheus metrics."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import openai

from mokv_examples.max_server import MaxServer

T = TypeVar("T")

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

    def __sub__(self, other: CacheReading) -> CacheReading:
        return CacheReading(
            self.device_hits - other.device_hits,
            self.external_hits - other.external_hits,
            self.misses - other.misses,
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
    )


def settled(read: Callable[[], T], *, every_s: float, hold_s: float, timeout_s: float) -> T:
    """`read()` once it returned the same value for `hold_s` seconds, read every
    `every_s` (its last value when `timeout_s` runs out first): what a server
    records behind its answers (metrics, pages written to a store) has arrived."""
    deadline = time.monotonic() + timeout_s
    value, since = read(), time.monotonic()
    while time.monotonic() < deadline and time.monotonic() - since < hold_s:
        time.sleep(every_s)
        if (now := read()) != value:
            value, since = now, time.monotonic()
    return value


def settled_reading(server: MaxServer, timeout_s: float = 30.0) -> CacheReading:
    """`cache_reading` once two readings a second apart agree (the metrics
    process receives them asynchronously)."""
    return settled(lambda: cache_reading(server), every_s=1.0, hold_s=1.0, timeout_s=timeout_s)


USED_PAGES = "maxserve_cache_num_used_blocks"
"""MAX's gauge of the device pages requests hold, set once per batch after the
batch's finished requests are released. Its exporter shows a gauge's value in
one scrape only (OpenTelemetry's last-value aggregation forgets it once
collected), so a scrape without it means no batch ran since the last scrape."""


def used_pages_of_next_batch(server: MaxServer, timeout_s: float = 60.0) -> float:
    """The used-pages gauge from the first scrape that carries it: the value
    the latest batch since the previous scrape recorded."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        m = server.metrics()
        if USED_PAGES in m.samples:
            return m.value(USED_PAGES)
        time.sleep(0.2)
    raise AssertionError(f"no batch recorded {USED_PAGES} within {timeout_s} s")


def wait_until_idle(server: MaxServer, timeout_s: float = 120.0) -> None:
    """Returns once a whole second passed with no batch (no gauge value between two scrapes)."""
    deadline = time.monotonic() + timeout_s
    server.metrics()  # takes any value recorded before now
    while time.monotonic() < deadline:
        time.sleep(1.0)
        if USED_PAGES not in server.metrics().samples:
            return
    raise AssertionError(f"the server still ran batches after {timeout_s} s")


def pages_held_when_idle(server: MaxServer) -> float:
    """The device pages requests hold once the server is idle: a one-token
    probe runs one batch, which releases the probe before it records the gauge."""
    wait_until_idle(server)
    probe = ask(server, [{"role": "user", "content": "Hi"}], max_tokens=1)
    assert probe.choices[0].finish_reason == "length"
    return used_pages_of_next_batch(server)


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
