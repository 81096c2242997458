"""The remote tier on a real redis-server: hits verified like the disk's, and a
server that is down, frozen or restarted costs misses within the timeout and
one warning, never a crash or a hang."""

from __future__ import annotations

import logging
import time
from contextlib import ExitStack
from pathlib import Path

import numpy as np
import pytest

from tests.support.tiers import PAGE_SIZE, RedisServer, admit, check_cached_pages, make_manager, run_prompt

TIMEOUT_S = 0.3


def test_a_new_manager_hits_through_the_server(redis_server: RedisServer) -> None:
    prompt = np.arange(4 * PAGE_SIZE + 3)
    with make_manager(remote_url=redis_server.url) as first:
        run_prompt(first, "a", prompt)
        first.flush()
        assert first.get_tier_metrics()["remote"].saved_pages == 4
        assert first.get_tier_usage()["remote"].used_pages == 4  # keys on the server
    with make_manager(remote_url=redis_server.url) as second:
        c = admit(second, "b", prompt)
        assert c.processed_length == 4 * PAGE_SIZE
        check_cached_pages(second, "b", c)
    with make_manager(remote_url=redis_server.url, model_id="another-model") as other:
        assert admit(other, "c", prompt).processed_length == 0


def test_a_record_planted_under_a_pages_key_is_rejected(redis_server: RedisServer) -> None:
    import redis

    prompt = np.arange(3 * PAGE_SIZE + 1)
    with make_manager(remote_url=redis_server.url) as first:
        run_prompt(first, "a", prompt)
    client = redis.Redis.from_url(redis_server.url)
    keys = sorted(client.keys("mokv:*"))
    values = [client.get(k) for k in keys]
    for key, value in zip(keys, values, strict=True):  # every page now holds another page's record
        client.set(key, values[(keys.index(key) + 1) % len(keys)] if value else value)
    with make_manager(remote_url=redis_server.url) as m:
        assert admit(m, "b", prompt).processed_length == 0
        assert m.get_tier_metrics()["remote"].rejected_pages == 1
    client.close()


def test_a_server_down_at_start_is_a_warning_and_misses(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    server = RedisServer(tmp_path)  # never started: nothing listens on its port
    with caplog.at_level(logging.WARNING, logger="mokv.tiers"):
        started = time.monotonic()
        with make_manager(remote_url=server.url, remote_timeout_s=TIMEOUT_S, remote_retry_s=60) as m:
            for i in range(3):
                run_prompt(m, f"p{i}", np.arange(2 * PAGE_SIZE + 1))
            m.flush()
            metrics = m.get_tier_metrics()["remote"]
        elapsed = time.monotonic() - started
    assert metrics.hit_pages == 0 and metrics.saved_pages == 0 and metrics.errors == 1
    assert elapsed < 5
    assert sum("unavailable" in r.getMessage() for r in caplog.records) == 1


def test_a_frozen_then_restarted_server_costs_only_misses(
    redis_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    prompt = np.arange(3 * PAGE_SIZE + 1)
    with make_manager(remote_url=redis_server.url) as seeded:
        run_prompt(seeded, "seed", prompt)
    with (
        caplog.at_level(logging.WARNING, logger="mokv.tiers"),
        make_manager(remote_url=redis_server.url, remote_timeout_s=TIMEOUT_S, remote_retry_s=0.5) as m,
    ):
        redis_server.pause()
        try:
            started = time.monotonic()
            c = admit(m, "frozen", prompt)
            waited = time.monotonic() - started
        finally:
            redis_server.resume()
        assert c.processed_length == 0
        assert waited < 4.0  # the timeout and one retry (0.6 s), with room for a loaded machine
        m.release("frozen")
        # Misses without asking while the store backs off, then it is asked again.
        assert admit(m, "backing-off", prompt).processed_length == 0
        m.release("backing-off")
        time.sleep(0.6)
        c = admit(m, "back", prompt)
        assert c.processed_length == 3 * PAGE_SIZE
        check_cached_pages(m, "back", c)
        m.release("back")

        # A restarted server has lost everything (no persistence): misses, then it fills again.
        redis_server.stop()
        redis_server.start()
        m.reset_prefix_cache()  # the device forgets its copies too
        assert run_prompt(m, "restarted", prompt).cached_prefix_length == 0
        m.flush()
        assert m.get_tier_metrics()["remote"].saved_pages == 3  # the loaded pages were not sent back
    messages = [r.getMessage() for r in caplog.records]
    assert sum("unavailable" in msg for msg in messages) >= 1
    assert all("redis://127.0.0.1" in msg for msg in messages)
    with make_manager(remote_url=redis_server.url) as fresh:
        assert admit(fresh, "after", prompt).processed_length == 3 * PAGE_SIZE


def cluster_port() -> int:
    """A free port whose cluster bus port (port + 10000) is free and valid too."""
    import socket

    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port + 10000 > 65535:
            continue
        with socket.socket() as bus:
            try:
                bus.bind(("127.0.0.1", port + 10000))
            except OSError:
                continue
        return port
    raise RuntimeError("no free port pair for a cluster node")


def form_cluster(nodes: list[RedisServer]) -> None:
    """Splits the 16384 hash slots over the nodes and joins them into one cluster."""
    import redis

    clients = [redis.Redis(host="127.0.0.1", port=n.port) for n in nodes]
    bounds = np.linspace(0, 16384, len(nodes) + 1).astype(int)
    for client, lo, hi in zip(clients, bounds, bounds[1:], strict=False):
        client.execute_command("CLUSTER", "ADDSLOTS", *range(lo, hi))
    for client in clients[1:]:
        client.execute_command("CLUSTER", "MEET", "127.0.0.1", nodes[0].port)

    def formed(client: redis.Redis) -> bool:
        info = client.execute_command("CLUSTER", "INFO").decode()
        return "cluster_state:ok" in info and f"cluster_known_nodes:{len(nodes)}" in info

    deadline = time.monotonic() + 20
    while not all(formed(c) for c in clients):
        assert time.monotonic() < deadline, "the cluster did not form within 20 s"
        time.sleep(0.05)
    for client in clients:
        client.close()


def test_a_redis_cluster_shares_prefixes_across_its_nodes(tmp_path: Path) -> None:
    with ExitStack() as stack:
        nodes = []
        for i in range(3):
            workdir = tmp_path / f"node{i}"
            workdir.mkdir()
            args = ("--cluster-enabled", "yes", "--cluster-config-file", str(workdir / "nodes.conf"))
            node = RedisServer(workdir, *args)
            node.port = cluster_port()
            nodes.append(stack.enter_context(node))
        form_cluster(nodes)
        prompt = np.arange(6 * PAGE_SIZE + 1)
        with make_manager(remote_url=nodes[0].url, remote_cluster=True) as first:
            run_prompt(first, "a", prompt)
            first.flush()
            assert first.get_tier_usage()["remote"].used_pages == 6  # summed over the primaries
        with make_manager(remote_url=nodes[2].url, remote_cluster=True) as second:
            c = admit(second, "b", prompt)
            assert c.processed_length == 6 * PAGE_SIZE
            check_cached_pages(second, "b", c)
            second.release("b")
            second.reset_prefix_cache()
            assert second.get_tier_usage()["remote"].used_pages == 0
