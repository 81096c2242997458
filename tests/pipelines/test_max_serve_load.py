"""A bounded load on `max serve` with mokv: 32 concurrent streaming chat
clients, each holding a 3-turn conversation (every turn resends the history),
through the official `openai` async client.

Every request completes with its tokens; at the end no page is held; and the
server's resident memory (all its processes) after the load is within
`RSS_GROWTH_BOUND` of what it was after a warm-up wave of the same shape.
"""

from __future__ import annotations

import asyncio

import pytest

openai = pytest.importorskip("openai")

from mokv_examples.chat_stream import stream_chat  # noqa: E402
from mokv_examples.max_server import MaxServer  # noqa: E402
from tests.support.serve_client import SYSTEM, pages_held_when_idle, settled_reading  # noqa: E402

pytestmark = pytest.mark.slow

CLIENTS, TURNS, NEW_TOKENS = 32, 3, 6
RSS_GROWTH_BOUND = 0.05
"""Most the server's resident memory may grow over the load, as a fraction of
it after the warm-up: a leak per request (pages, contexts, table rows) would
grow with the 96 requests; allocator noise stays well under it."""


async def _conversation(api: openai.AsyncOpenAI, model: str, index: int, turns: int) -> list[int]:
    """One client's turns, each streamed to the end; the tokens each turn received."""
    messages = [{"role": "system", "content": SYSTEM}]
    received = []
    for turn in range(turns):
        question = f"Client {index}, question {turn}: what is page {index * 7 + turn}?"
        messages.append({"role": "user", "content": question})
        answer = await stream_chat(api, model, messages, NEW_TOKENS)
        assert answer.finish_reason == "length" and answer.text, (index, turn, answer)
        received.append(answer.completion_tokens)
        messages.append({"role": "assistant", "content": answer.text})
    return received


async def _wave(server: MaxServer, turns: int) -> list[list[int]]:
    async with openai.AsyncOpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=900) as api:
        return await asyncio.gather(*(_conversation(api, server.model, i, turns) for i in range(CLIENTS)))


def test_32_streaming_clients_for_3_turns(mokv_server: MaxServer) -> None:
    asyncio.run(_wave(mokv_server, turns=1))  # warm-up: every batch shape and the tables' largest sizes
    warm = mokv_server.rss_bytes()
    before = settled_reading(mokv_server)
    received = asyncio.run(_wave(mokv_server, TURNS))
    after = settled_reading(mokv_server)
    grown = mokv_server.rss_bytes() - warm
    assert received == [[NEW_TOKENS] * TURNS] * CLIENTS
    assert pages_held_when_idle(mokv_server) == 0
    assert (after - before).device_hits > 0  # later turns (and the shared system prompt) were served from cache
    assert grown <= RSS_GROWTH_BOUND * warm, f"resident memory grew by {grown / 2**20:.0f} MiB over {warm / 2**20:.0f}"
    print(f"RSS after warm-up {warm / 2**20:.0f} MiB, grew {grown / 2**20:+.1f} MiB over {CLIENTS * TURNS} requests")
