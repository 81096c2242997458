"""The disk tier: warm restarts, shared directories, damaged files, the byte
budget, and a disk that stops taking writes."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import numpy as np
import pytest

from mokv.tiers import KVConnectorConfig
from mokv.tiers.disk import SUFFIX
from tests.support.tiers import PAGE_SIZE, admit, check_cached_pages, make_manager, run_prompt, small_params


def page_files(directory: Path) -> list[Path]:
    return sorted(directory.glob(f"*/*/*{SUFFIX}"))


@pytest.mark.parametrize("copies", ["memcpy", "buffer"])
def test_a_new_manager_hits_what_an_earlier_one_computed(
    tmp_path: Path, copies: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    if copies == "buffer":  # the accelerator path: enqueued driver copies, awaited by runtime_inputs
        import mokv.tiers.store as store

        monkeypatch.setattr(store, "_host_views", lambda unit: None)
    prompt = np.arange(100, 100 + 5 * PAGE_SIZE + 2)
    with make_manager(disk_offload_dir=tmp_path) as first:
        run_prompt(first, "a", prompt)
        first.flush()
        assert first.get_tier_metrics()["disk"].saved_pages == 5
        assert first.get_num_used_disk_pages() == 5
    assert len(page_files(tmp_path)) == 5

    with make_manager(disk_offload_dir=tmp_path) as second:
        assert second.get_num_used_disk_pages() == 5  # found at start-up
        c = admit(second, "b", prompt)
        assert c.processed_length == 5 * PAGE_SIZE and c.cached_prefix_length == 5 * PAGE_SIZE
        check_cached_pages(second, "b", c)
        metrics = second.get_tier_metrics()["disk"]
        assert metrics.hit_pages == 5 and metrics.rejected_pages == 0
        assert second.get_metrics_aggregated().h2d_blocks_copied == 5
        # Loaded pages join the device prefix cache: a twin request hits on the device.
        twin = admit(second, "twin", prompt)
        assert twin.processed_length == 5 * PAGE_SIZE
        assert second.get_tier_metrics()["disk"].hit_pages == 5


def page_keys(m, prompt: np.ndarray, n: int) -> list[str]:
    """The disk file names (chained keys) of the prompt's first `n` pages."""
    keyer = m._replicas[0].keyer
    return [k.hex() for k in keyer.chain(prompt[: n * PAGE_SIZE].reshape(n, PAGE_SIZE), keyer.root())]


def test_a_hit_continues_a_device_hit_and_stops_at_the_first_gap(tmp_path: Path) -> None:
    prompt = np.arange(6 * PAGE_SIZE + 1)
    with make_manager(disk_offload_dir=tmp_path) as first:
        run_prompt(first, "a", prompt)
    with make_manager(disk_offload_dir=tmp_path) as second:
        head = run_prompt(second, "head", prompt[: 2 * PAGE_SIZE + 1])  # now on the device
        assert head.processed_length == 2 * PAGE_SIZE + 1
        gap = page_keys(second, prompt, 6)[4]
        (path,) = [p for p in page_files(tmp_path) if p.stem == gap]
        path.unlink()
        c = admit(second, "b", prompt)
        assert c.processed_length == 4 * PAGE_SIZE  # 2 from the device, 2 from the disk
        assert second.get_tier_metrics()["disk"].hit_pages == 2 + 2
        check_cached_pages(second, "b", c)
        second.release("b")
        second.reset_prefix_cache()
    assert page_files(tmp_path) == []  # a reset drops the layout's records for every process


def test_a_different_model_or_layout_never_reads_anothers_pages(tmp_path: Path) -> None:
    prompt = np.arange(3 * PAGE_SIZE + 1)
    with make_manager(disk_offload_dir=tmp_path, model_id="model-a") as a:
        run_prompt(a, "a", prompt)
    for other in (
        {"model_id": "model-b"},
        {"model_id": "model-a", "params": small_params(head_dim=4, n_kv_heads=4)},  # same bytes per page
    ):
        with make_manager(disk_offload_dir=tmp_path, **other) as m:
            c = admit(m, "b", prompt)
            assert c.processed_length == 0
            assert m.get_tier_metrics()["disk"].rejected_pages == 0  # it never even opened them


@pytest.mark.parametrize("damage", ["truncate", "flip-payload", "flip-tokens", "foreign", "swap"])
def test_a_damaged_file_is_a_miss_and_is_removed(tmp_path: Path, damage: str) -> None:
    prompt = np.arange(3 * PAGE_SIZE + 1)
    with make_manager(disk_offload_dir=tmp_path) as first:
        run_prompt(first, "a", prompt)
    files = page_files(tmp_path)
    # Damage the file of the first page (the one whose parent is the root).
    with make_manager(disk_offload_dir=tmp_path) as probe:
        (first_key,) = page_keys(probe, prompt, 1)
    target = next(p for p in files if p.stem == first_key)
    data = bytearray(target.read_bytes())
    if damage == "truncate":
        data = data[: len(data) // 2]
    elif damage == "flip-payload":
        data[-100] ^= 0x40
    elif damage == "flip-tokens":
        data[110] ^= 0x01
    elif damage == "foreign":
        data[8] ^= 0xFF  # the fingerprint field
    else:  # another page's (valid) record under this name
        data = bytearray(next(p for p in files if p != target).read_bytes())
    target.write_bytes(bytes(data))

    with make_manager(disk_offload_dir=tmp_path) as m:
        c = admit(m, "b", prompt)
        assert c.processed_length == 0  # the chain starts with the damaged page
        metrics = m.get_tier_metrics()["disk"]
        assert metrics.rejected_pages == 1 and metrics.hit_pages == 0
    assert not target.exists()


def test_the_budget_evicts_least_recently_used_files(tmp_path: Path) -> None:
    with make_manager(disk_offload_dir=tmp_path) as probe:
        record_bytes = probe._replicas[0].tiers[0].codec.record_bytes
    budget_gb = 4.5 * record_bytes / (1 << 30)  # room for 4 records
    prompts = [np.arange(1000 * i, 1000 * i + PAGE_SIZE + 1) for i in range(6)]
    with make_manager(disk_offload_dir=tmp_path, disk_offload_max_gb=budget_gb) as m:
        for i, prompt in enumerate(prompts[:4]):
            run_prompt(m, f"p{i}", prompt)
            m.flush()  # written in order, with distinct mtimes: the next process's scan orders by them
            time.sleep(0.02)
        assert m.get_num_disk_pages() == 4 and m.get_num_used_disk_pages() == 4
    with make_manager(disk_offload_dir=tmp_path, disk_offload_max_gb=budget_gb) as m:
        assert admit(m, "hit0", prompts[0]).processed_length == PAGE_SIZE  # p0 is now most recent
        for i, prompt in enumerate(prompts[4:]):
            run_prompt(m, f"new{i}", prompt)
        m.flush()
        assert m.get_num_used_disk_pages() == 4
    assert len(page_files(tmp_path)) == 4
    with make_manager(disk_offload_dir=tmp_path, disk_offload_max_gb=budget_gb) as m:
        hits = [admit(m, f"q{i}", p).processed_length for i, p in enumerate(prompts)]
    assert hits == [PAGE_SIZE, 0, 0, PAGE_SIZE, PAGE_SIZE, PAGE_SIZE]


def test_an_unusable_directory_disables_the_tier_at_start(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("")
    with caplog.at_level(logging.WARNING, logger="mokv.tiers"), make_manager(disk_offload_dir=not_a_dir) as m:
        run_prompt(m, "a", np.arange(2 * PAGE_SIZE + 1))
        assert admit(m, "b", np.arange(2 * PAGE_SIZE + 1)).processed_length == 2 * PAGE_SIZE
        metrics = m.get_tier_metrics()["disk"]
        assert metrics.saved_pages == 0 and metrics.errors == 1
    assert sum("disabled" in r.getMessage() for r in caplog.records) == 1


def test_a_full_disk_disables_the_tier_with_one_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    import errno

    import mokv.tiers.disk as disk

    real_replace = os.replace

    def full(src: str, dst: str) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(disk.os, "replace", full)
    with caplog.at_level(logging.WARNING, logger="mokv.tiers"), make_manager(disk_offload_dir=tmp_path) as m:
        for i in range(3):
            run_prompt(m, f"p{i}", np.arange(100 * i, 100 * i + 2 * PAGE_SIZE + 1))
            m.flush()
        metrics = m.get_tier_metrics()["disk"]
        assert metrics.saved_pages == 0 and metrics.dropped_saves >= 2 and metrics.errors == 1
        # Serving goes on: the device cache still works.
        assert admit(m, "again", np.arange(2 * PAGE_SIZE + 1)).processed_length == 2 * PAGE_SIZE
    monkeypatch.setattr(disk.os, "replace", real_replace)
    warnings = [r for r in caplog.records if "disabled" in r.getMessage()]
    assert len(warnings) == 1 and "No space left" in warnings[0].getMessage()
    assert not list(tmp_path.rglob("*.tmp"))


def test_several_caches_behind_one_page_table_restore_together(tmp_path: Path) -> None:
    """A `MultiKVCacheParams` page spans every leaf cache: one record holds them all."""
    from max.dtype import DType

    from mokv import KVCacheParams, MultiKVCacheParams, PagedKVCacheManager, TextContext

    def leaf(heads: int) -> KVCacheParams:
        return KVCacheParams(
            DType.float32, n_kv_heads=heads, head_dim=4, num_layers=1, page_size=PAGE_SIZE, enable_prefix_caching=True
        )

    params = MultiKVCacheParams({"target": leaf(2), "draft": leaf(1)})
    config = KVConnectorConfig(model_id="two-caches", disk_offload_dir=tmp_path)
    with PagedKVCacheManager(params, None, 8, max_batch_size=2, connector_config=config) as m:
        c = TextContext("a", np.arange(2 * PAGE_SIZE + 1))
        m.claim("a")
        m.alloc(c)
        for offset, buffer in enumerate(m.get_device_buffer().values()):
            pages = buffer.values[0].to_numpy()
            for i, page in enumerate(m.get_req_blocks("a")):
                pages[page] = 100 * offset + i
        c.update(0)
        m.step([[c]])
        m.release("a")
    with PagedKVCacheManager(params, None, 8, max_batch_size=2, connector_config=config) as m:
        c = TextContext("b", np.arange(2 * PAGE_SIZE + 1))
        m.claim("b")
        m.alloc(c)
        m.runtime_inputs([[c]])
        assert c.processed_length == 2 * PAGE_SIZE
        for offset, buffer in enumerate(m.get_device_buffer().values()):
            pages = buffer.values[0].to_numpy()
            for i, page in enumerate(m.get_req_blocks("b")[:2]):
                assert (pages[page] == 100 * offset + i).all()


def test_a_page_replacing_a_colliding_entry_is_saved_through(tmp_path: Path) -> None:
    """A new page whose device hash collides with an unheld cached entry (a
    fake hash here: the page's index) replaces that entry on the device, and
    is saved to the disk tier under its own chained key like any other."""
    a_prompt, b_prompt = np.arange(2 * PAGE_SIZE + 1), np.arange(500, 500 + 2 * PAGE_SIZE + 1)
    with make_manager(disk_offload_dir=tmp_path) as m:
        m.enable_runtime_checks = False  # the audit rehashes with the real hash
        m._hasher.hash_pages = lambda tokens, parent=None: list(range(len(tokens) // PAGE_SIZE))  # type: ignore[method-assign]
        run_prompt(m, "a", a_prompt)
        run_prompt(m, "b", b_prompt)  # "hashes" 0 and 1 again: a's unheld entries are replaced
        m.flush()
        assert m.get_tier_metrics()["disk"].saved_pages == 2 + 2
    assert {p.stem for p in page_files(tmp_path)} == {*page_keys(m, a_prompt, 2), *page_keys(m, b_prompt, 2)}
    with make_manager(disk_offload_dir=tmp_path) as second:  # b's pages come back from the disk
        c = admit(second, "c", b_prompt)
        assert c.processed_length == 2 * PAGE_SIZE
        check_cached_pages(second, "c", c)
