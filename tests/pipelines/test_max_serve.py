"""`max serve` with mokv's architecture (cache, kernels, manager) on a loopback
port, driven by the official `openai` client; what the cache did is read from
the server's own Prometheus metrics (`tests/support/serve_client.py`).

One server for the whole session (`conftest.mokv_server`): SmolLM2 float32,
128-token pages, a host tier and a Redis tier, clients' cache salts honoured
(`X-Cache-Salt`). The tests run one after another, so each reads the metrics
its own requests moved.
"""

from __future__ import annotations

import pytest

openai = pytest.importorskip("openai")

from mokv_examples.max_server import MaxServer  # noqa: E402
from tests.support.pipelines import SERVE_PAGE_SIZE  # noqa: E402
from tests.support.serve_client import (  # noqa: E402
    SYSTEM,
    ask,
    client,
    pages_held_when_idle,
    settled_reading,
    used_pages_of_next_batch,
)

pytestmark = pytest.mark.slow

PS = SERVE_PAGE_SIZE


def _pages(tokens: int) -> int:
    """Tokens in the whole pages of a `tokens`-token prefix."""
    return tokens // PS * PS


def test_chat_completion_repeats_itself_from_the_prefix_cache(mokv_server: MaxServer) -> None:
    """A greedy answer computed, then served again with its prompt's pages
    from the cache: the same text, and the second prompt's full pages were hits."""
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is a page?"}]
    before = settled_reading(mokv_server)
    first = ask(mokv_server, messages)
    middle = settled_reading(mokv_server)
    second = ask(mokv_server, messages)
    after = settled_reading(mokv_server)
    assert first.choices[0].message.content and first.choices[0].message.content == second.choices[0].message.content
    prompt = first.usage.prompt_tokens
    assert prompt > 2 * PS and first.usage.completion_tokens == 12
    assert (middle - before).hits + (middle - before).misses == prompt
    assert (after - middle).device_hits == _pages(prompt - 1)  # the last token is never served from cache
    assert (after - middle).misses == prompt - _pages(prompt - 1)


def test_streaming_chat_and_text_completions_match_their_whole_answers(mokv_server: MaxServer) -> None:
    api = client(mokv_server)
    messages = [{"role": "user", "content": "Name two colours."}]
    whole = ask(mokv_server, messages).choices[0].message.content
    pieces = api.chat.completions.create(
        model=mokv_server.model,
        messages=messages,
        max_tokens=12,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    assert "".join(chunk.choices[0].delta.content or "" for chunk in pieces if chunk.choices) == whole
    prompt = "The three primary colours are"
    text = api.completions.create(model=mokv_server.model, prompt=prompt, max_tokens=10, temperature=0)
    assert text.choices[0].text and text.usage.completion_tokens == 10
    streamed = api.completions.create(model=mokv_server.model, prompt=prompt, max_tokens=10, temperature=0, stream=True)
    assert "".join(chunk.choices[0].text for chunk in streamed if chunk.choices) == text.choices[0].text


def test_a_multi_turn_conversation_hits_the_prefix_cache(mokv_server: MaxServer) -> None:
    """Each turn resends the conversation: its hits cover at least the pages
    of the previous turn's prompt, and nothing is counted twice."""
    messages = [{"role": "system", "content": SYSTEM}]
    previous_prompt = 0
    for turn, question in enumerate(("What is evicted first?", "And where can it be found again?", "Why?")):
        messages.append({"role": "user", "content": question})
        before = settled_reading(mokv_server)
        answer = ask(mokv_server, messages, max_tokens=16)
        moved = settled_reading(mokv_server) - before
        prompt = answer.usage.prompt_tokens
        assert moved.hits + moved.misses == prompt
        if turn:
            assert _pages(previous_prompt) <= moved.device_hits <= _pages(prompt - 1), (turn, moved)
        messages.append({"role": "assistant", "content": answer.choices[0].message.content})
        previous_prompt = prompt


def test_a_client_that_disconnects_mid_stream_leaves_no_page_held(mokv_server: MaxServer) -> None:
    assert pages_held_when_idle(mokv_server) == 0
    api = client(mokv_server)
    stream = api.chat.completions.create(
        model=mokv_server.model,
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Tell a very long story."}],
        max_tokens=1500,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    try:
        received = 0
        for chunk in stream:
            received += bool(chunk.choices and chunk.choices[0].delta.content)
            if received == 4:
                break
        held_while_streaming = used_pages_of_next_batch(mokv_server)
    finally:
        stream.close()  # the server notices the closed connection and cancels the request
    assert held_while_streaming >= 3  # the system prompt's pages and the story's
    assert pages_held_when_idle(mokv_server) == 0


def test_bad_requests_get_4xx_and_the_server_keeps_serving(mokv_server: MaxServer) -> None:
    api = client(mokv_server)
    too_long = "cache " * 1500  # over --max-length 1024
    bad_calls = {
        "prompt over the context": {"messages": [{"role": "user", "content": too_long}]},
        "negative temperature": {"temperature": -1.0},
        "negative max_tokens": {"max_tokens": -5},
        "top_p over 1": {"top_p": 7.0},
        "negative top_k": {"extra_body": {"top_k": -3}},
        "50 top logprobs": {"logprobs": True, "top_logprobs": 50},
        "a temperature that is a word": {"extra_body": {"temperature": "hot"}},
        "a wizard's message": {"messages": [{"role": "wizard", "content": "Hello"}]},
        "no messages": {"messages": []},
        "unknown model": {"model": "no-such-model"},
    }
    for name, overrides in bad_calls.items():
        call = {
            "model": mokv_server.model,
            "messages": [{"role": "user", "content": "Hello"}],
            "max_tokens": 4,
            **overrides,
        }
        with pytest.raises(openai.APIStatusError) as refused:
            api.chat.completions.create(**call)
        assert 400 <= refused.value.status_code < 500, (name, refused.value.status_code, refused.value.message)
    answer = ask(mokv_server, [{"role": "user", "content": "Still there?"}], max_tokens=4)
    assert answer.choices[0].message.content
    assert pages_held_when_idle(mokv_server) == 0


def test_different_cache_salts_never_share_a_page(mokv_server: MaxServer) -> None:
    """The same long prompt (first seen here) under salt A, then B, then
    none, then A again: only A's second request is served from the cache (any tier)."""
    messages = [{"role": "system", "content": "Tenants ahead. " + SYSTEM}, {"role": "user", "content": "Which tenant?"}]
    hits = {}
    for i, salt in enumerate(("tenant-a", "tenant-b", None, "tenant-a")):
        before = settled_reading(mokv_server)
        headers = {"X-Cache-Salt": salt} if salt else {}
        answer = ask(mokv_server, messages, max_tokens=2, extra_headers=headers)
        hits[i] = (settled_reading(mokv_server) - before).hits
    prompt = answer.usage.prompt_tokens
    assert hits == {0: 0, 1: 0, 2: 0, 3: _pages(prompt - 1)}
