"""Two processes sharing prefixes through one disk directory and through one
Redis server: the second hits on what the first computed, with the right KV."""

from __future__ import annotations

import json
import subprocess
from contextlib import ExitStack
from pathlib import Path

import numpy as np
import pytest

from tests.support.tiers import (
    PAGE_SIZE,
    RedisServer,
    admit,
    check_cached_pages,
    make_manager,
    run_prompt,
    start_worker,
)


def run_worker(config: dict, prompts: list[list[int]], timeout: float = 120) -> dict:
    worker = start_worker({"config": config, "prompts": prompts}, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        out, err = worker.communicate(timeout=timeout)
    finally:
        worker.kill()
        worker.wait(timeout=10)
    assert worker.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1])


def shared_prefix_prompts(seed: int) -> list[list[int]]:
    """Four prompts: a 3-page shared head, then 2 pages of their own, then a stray token."""
    rng = np.random.default_rng(seed)
    head = rng.integers(0, 5000, 3 * PAGE_SIZE)
    return [np.concatenate([head, rng.integers(0, 5000, 2 * PAGE_SIZE + 1)]).tolist() for _ in range(4)]


@pytest.mark.parametrize("tier", ["disk", "remote"])
def test_a_second_process_hits_what_the_first_computed(tier: str, tmp_path: Path) -> None:
    server = None
    if tier == "disk":
        config = {"disk_offload_dir": str(tmp_path / "kv")}
    else:
        server = RedisServer(tmp_path)
        server.start()
        config = {"remote_url": server.url}
    try:
        prompts = shared_prefix_prompts(7)
        first = run_worker(config, prompts)
        # Alone, the first process shares only the 3-page head between its prompts.
        assert first["cached"] == [0] + [3 * PAGE_SIZE] * 3
        assert first["metrics"][tier]["saved_pages"] == 3 + 4 * 2
        second = run_worker(config, prompts)
        assert second["cached"] == [5 * PAGE_SIZE] * 4
        assert second["metrics"][tier]["hit_pages"] == 5 + 3 * 2
        assert second["metrics"][tier]["rejected_pages"] == 0
    finally:
        if server is not None:
            server.stop()


def test_processes_writing_one_directory_at_once_never_serve_wrong_kv(tmp_path: Path) -> None:
    """Four processes run the same prompts at the same time: the same pages
    are written concurrently and read while being replaced."""
    config = {"disk_offload_dir": str(tmp_path / "kv")}
    prompts = shared_prefix_prompts(11) * 3
    spec = {"config": config, "prompts": prompts}
    workers = [start_worker(spec, stdout=subprocess.PIPE, stderr=subprocess.PIPE) for _ in range(4)]
    try:
        results = [w.communicate(timeout=180) for w in workers]
    finally:
        for w in workers:
            if w.poll() is None:
                w.kill()
                w.wait(timeout=10)
    for w, (out, err) in zip(workers, results, strict=True):
        assert w.returncode == 0, err[-3000:]  # every page served was checked in the worker
        assert json.loads(out.strip().splitlines()[-1])["metrics"]["disk"]["rejected_pages"] == 0
    assert not list((tmp_path / "kv").rglob("*.tmp"))


@pytest.mark.parametrize("tier", ["disk", "remote"])
def test_cache_salts_keep_tenants_apart_on_shared_tiers(tier: str, tmp_path: Path) -> None:
    with ExitStack() as stack:
        if tier == "disk":
            config = {"disk_offload_dir": tmp_path / "kv"}
        else:
            config = {"remote_url": stack.enter_context(RedisServer(tmp_path)).url}
        prompt = np.arange(3 * PAGE_SIZE + 1)
        with make_manager(**config) as first:
            run_prompt(first, "alice", prompt, salt="alice")
        with make_manager(**config) as second:
            assert admit(second, "bob", prompt, salt="bob").processed_length == 0
            assert admit(second, "anon", prompt).processed_length == 0
            alice = admit(second, "alice", prompt, salt="alice")
            assert alice.processed_length == 3 * PAGE_SIZE
            check_cached_pages(second, "alice", alice)
            assert second.get_tier_metrics()[tier].rejected_pages == 0  # they never even asked for her keys
