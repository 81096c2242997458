"""Random workloads over every tier at once, and a writer killed mid-write:
pages served are always the right ones, and no tier leaks entries or files."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest

from mokv.tiers.disk import SUFFIX
from tests.support.tiers import (
    PAGE_SIZE,
    RedisServer,
    admit,
    check_cached_pages,
    make_manager,
    run_prompt,
    small_params,
    start_worker,
)


def random_prompt(rng: np.random.Generator, heads: list[np.ndarray]) -> np.ndarray:
    """One of a few shared heads (cut at a random page), then a random tail."""
    head = heads[rng.integers(len(heads))][: PAGE_SIZE * int(rng.integers(0, 5))]
    tail = rng.integers(0, 3000, int(rng.integers(1, 3 * PAGE_SIZE)))
    return np.concatenate([head, tail])


@pytest.mark.parametrize("seed", range(3))
def test_random_workloads_serve_right_pages_and_leak_nothing(seed: int, tmp_path: Path) -> None:
    rng = np.random.default_rng(seed)
    heads = [rng.integers(0, 3000, 4 * PAGE_SIZE) for _ in range(4)]
    server = RedisServer(tmp_path)
    server.start()
    disk = tmp_path / "kv"
    try:
        with make_manager(disk_offload_dir=disk) as probe:
            record_bytes = probe._replicas[0].tiers[0].codec.record_bytes
        budget_pages = 12
        config = {
            "disk_offload_dir": disk,
            "disk_offload_max_gb": budget_pages * record_bytes / (1 << 30),
            "remote_url": server.url,
        }
        for process in range(2):  # a second manager starts on what the first left
            with make_manager(total_num_pages=16, total_num_host_pages=6, **config) as m:
                for i in range(40):
                    prompt = random_prompt(rng, heads)
                    held = []
                    if rng.random() < 0.3:  # a request that stays, taking pages meanwhile
                        held.append(admit(m, f"held{i}", random_prompt(rng, heads)))
                    check = admit(m, f"check{i}", prompt)
                    check_cached_pages(m, f"check{i}", check)
                    m.release(f"check{i}")
                    run_prompt(m, f"r{process}-{i}", prompt)
                    for c in held:
                        check_cached_pages(m, c.request_id, c)
                        m.release(c.request_id)
                m.flush()
                tiers = m.get_tier_metrics()
                assert all(t.rejected_pages == 0 and t.errors == 0 for t in tiers.values())
                assert tiers["host"].hit_pages + tiers["disk"].hit_pages + tiers["remote"].hit_pages > 0
                usage = m.get_tier_usage()
                assert usage["host"].used_pages <= 6
                files = {p.stem for p in disk.rglob(f"*{SUFFIX}")}
                disk_store = m._replicas[0].tiers[1].store
                assert files == {k.hex() for k in disk_store._files}  # the LRU view is exactly the files
                assert len(files) <= budget_pages and usage["disk"].used_bytes <= budget_pages * record_bytes
                assert not list(disk.rglob("*.tmp"))
        with make_manager(total_num_pages=16, total_num_host_pages=6, **config) as m:
            run_prompt(m, "last", heads[0])
            m.reset_prefix_cache()
            assert m.get_num_used_host_pages() == 0
            assert not list(disk.rglob(f"*{SUFFIX}"))
            assert m.get_tier_usage()["remote"].used_pages == 0
    finally:
        server.stop()


def kill_while_writing(spec: dict, directory: Path) -> int:
    """Runs a writer process and SIGKILLs it the moment a temporary file shows
    up under `directory` beside at least one whole prompt's page files;
    returns how many temporary files it left."""
    writer = start_worker(spec, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while True:
            names = [name for _, _, names in os.walk(directory) for name in names]
            if sum(n.endswith(SUFFIX) for n in names) >= 3 and any(n.endswith(".tmp") for n in names):
                break
            assert writer.poll() is None and time.monotonic() < deadline, "the writer never wrote"
        writer.send_signal(signal.SIGKILL)
    finally:
        writer.kill()
        writer.wait(timeout=30)
    return len(list(directory.rglob("*.tmp")))


def test_a_writer_killed_mid_write_leaves_no_corrupt_hit(tmp_path: Path) -> None:
    """Pages of 4 MiB; SIGKILL lands while a page file is being written (a
    temporary file is left). Every page file left verifies and serves the
    right KV; the temporary files are never hits."""
    big = {"head_dim": 65536, "num_layers": 2, "n_kv_heads": 2}
    rng = np.random.default_rng(5)
    prompts = [rng.integers(0, 3000, 3 * PAGE_SIZE + 1).tolist() for _ in range(30)]
    for attempt in range(5):
        directory = tmp_path / f"kv{attempt}"
        spec = {"config": {"disk_offload_dir": str(directory)}, "prompts": prompts, "params": big}
        if kill_while_writing(spec, directory):
            break
    else:
        pytest.fail("in 5 tries, SIGKILL never caught a writer mid-write")
    with make_manager(total_num_pages=16, params=small_params(**big), disk_offload_dir=directory) as m:
        served = 0
        for i, tokens in enumerate(prompts):
            c = admit(m, f"p{i}", np.asarray(tokens))
            check_cached_pages(m, c.request_id, c)
            served += c.processed_length // PAGE_SIZE
            m.release(c.request_id)
        assert m.get_tier_metrics()["disk"].rejected_pages == 0
    assert served >= 3
