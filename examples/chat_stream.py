"""One streamed chat turn through the official `openai` async client, timed:
what `mokv bench serve` measures and the `max serve` load test checks."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class StreamedTurn:
    """What one streamed answer brought back."""

    text: str
    completion_tokens: int
    """As the server counted them (its final usage chunk)."""
    finish_reason: str | None
    ttft_s: float
    """From sending the request to the first chunk with content."""
    ended: float
    """`time.perf_counter()` when the stream ended."""


async def stream_chat(api: Any, model: str, messages: list[dict[str, str]], max_tokens: int) -> StreamedTurn:
    """Streams a greedy answer of exactly `max_tokens` tokens (EOS ignored)
    to `messages` from `api` (an `openai.AsyncOpenAI`)."""
    sent = time.perf_counter()
    first = None
    text: list[str] = []
    tokens, finish = 0, None
    stream = await api.chat.completions.create(
        model=model,
        messages=messages,
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    async for chunk in stream:
        if chunk.choices:
            delta = chunk.choices[0].delta.content
            if delta:
                first = first or time.perf_counter()
                text.append(delta)
            finish = chunk.choices[0].finish_reason or finish
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    ended = time.perf_counter()
    return StreamedTurn("".join(text), tokens, finish, (first or ended) - sent, ended)
