"""Two `max serve` processes with mokv on one Redis: the second serves a long
prompt only the first has seen, its pages loaded from the shared remote tier
(verified records: chained keys, tokens, MAC), and answers as the first did.

The first server is the session's (`conftest.mokv_server`); the second runs
the same options (so MAX loads the first one's compiled graph from its cache)
only for this test.
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("openai")
redis = pytest.importorskip("redis")

from mokv_examples.local_redis import LocalRedis  # noqa: E402
from mokv_examples.max_server import MaxServer, ServeOptions  # noqa: E402
from tests.support.pipelines import SERVE_PAGE_SIZE  # noqa: E402
from tests.support.serve_client import SYSTEM, ask, settled, settled_reading  # noqa: E402

pytestmark = pytest.mark.slow


def _settled_key_count(url: str, timeout_s: float = 60.0) -> int:
    """Keys in the Redis database once the count held still for two seconds
    (the servers write their pages behind the requests)."""
    store = redis.Redis.from_url(url)
    return settled(store.dbsize, every_s=0.25, hold_s=2.0, timeout_s=timeout_s)


def test_a_second_server_serves_the_first_ones_prompt_from_redis(
    mokv_server: MaxServer, serve_options: ServeOptions, serve_redis: LocalRedis, tmp_path: Path
) -> None:
    messages = [
        {"role": "system", "content": SYSTEM + " This conversation was first seen by the first server."},
        {"role": "user", "content": "Summarise the service in one sentence."},
    ]
    first = ask(mokv_server, messages, max_tokens=12)
    prompt = first.usage.prompt_tokens
    full_pages = (prompt - 1) // SERVE_PAGE_SIZE
    assert full_pages >= 2
    assert _settled_key_count(serve_redis.url) >= full_pages
    with MaxServer(serve_options, tmp_path / "second.log") as second:
        before = settled_reading(second)
        again = ask(second, messages, max_tokens=12)
        moved = settled_reading(second) - before
    assert moved.external_hits == full_pages * SERVE_PAGE_SIZE and moved.device_hits == 0
    assert again.choices[0].message.content == first.choices[0].message.content
