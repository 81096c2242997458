"""Who may write the shared tiers: records carry an HMAC under the operator's
key, and the remote store checks the server's password or ACL user at start-up.
Secrets never reach logs, errors or reports."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest

import mokv.tiers.config as tier_config
from mokv.tiers import KVConnectorConfig, RemoteStoreError
from mokv_examples.pipeline import GenerationConfig
from tests.support.tiers import PAGE_SIZE, RedisServer, admit, check_cached_pages, make_manager, run_prompt

PROMPT = np.arange(3 * PAGE_SIZE + 1)
KEY = b"correct horse battery staple"


@pytest.fixture
def shared(tmp_path: Path, request: pytest.FixtureRequest):
    """The tier config of each parametrized store: a disk directory or a fresh redis-server."""
    if request.param == "disk":
        yield request.param, {"disk_offload_dir": tmp_path / "kv"}
    else:
        with RedisServer(tmp_path) as server:
            yield request.param, {"remote_url": server.url}


@pytest.mark.parametrize("shared", ["disk", "remote"], indirect=True)
def test_records_planted_without_the_key_are_rejected(shared) -> None:
    tier, config = shared
    with make_manager(**config) as attacker:  # writes with no key: a plain checksum
        run_prompt(attacker, "planted", PROMPT)
    with make_manager(integrity_key=KEY, **config) as m:
        assert admit(m, "victim", PROMPT).processed_length == 0
        metrics = m.get_tier_metrics()[tier]
        assert metrics.unauthenticated_pages == metrics.rejected_pages == 1 and metrics.hit_pages == 0
        m.release("victim")
        # Its own records (written over the planted ones) verify.
        m.reset_prefix_cache()
        run_prompt(m, "honest", PROMPT)
    with make_manager(integrity_key=KEY, **config) as m:
        c = admit(m, "reader", PROMPT)
        assert c.processed_length == 3 * PAGE_SIZE
        check_cached_pages(m, "reader", c)


@pytest.mark.parametrize("shared", ["disk", "remote"], indirect=True)
def test_records_under_another_key_are_rejected(shared) -> None:
    tier, config = shared
    with make_manager(integrity_key=b"another operator's key", **config) as other:
        run_prompt(other, "theirs", PROMPT)
    with make_manager(integrity_key=KEY, **config) as m:
        assert admit(m, "mine", PROMPT).processed_length == 0
        assert m.get_tier_metrics()[tier].unauthenticated_pages == 1


def test_a_keyed_record_modified_in_place_is_rejected(tmp_path: Path) -> None:
    with make_manager(integrity_key=KEY, disk_offload_dir=tmp_path) as m:
        run_prompt(m, "a", PROMPT)
    for path in tmp_path.rglob("*.kvpage"):
        data = bytearray(path.read_bytes())
        data[-40] ^= 0x01  # the last payload byte
        path.write_bytes(bytes(data))
    with make_manager(integrity_key=KEY, disk_offload_dir=tmp_path) as m:
        assert admit(m, "b", PROMPT).processed_length == 0
        assert m.get_tier_metrics()["disk"].unauthenticated_pages == 1


def test_the_key_comes_from_a_file_or_the_environment_and_is_never_shown(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    key_file = tmp_path / "kv.key"
    key_file.write_bytes(KEY + b"\n")
    with caplog.at_level(logging.DEBUG), make_manager(integrity_key_file=key_file, disk_offload_dir=tmp_path) as m:
        run_prompt(m, "a", PROMPT)
    monkeypatch.setenv(tier_config.INTEGRITY_KEY_ENV, KEY.decode())
    config = KVConnectorConfig(disk_offload_dir=tmp_path)
    assert config.resolve_integrity_key() == KEY
    with caplog.at_level(logging.DEBUG), make_manager(disk_offload_dir=tmp_path) as m:
        assert admit(m, "b", PROMPT).processed_length == 3 * PAGE_SIZE
    assert KEY.decode() not in caplog.text and KEY.decode() not in repr(KVConnectorConfig(integrity_key=KEY))
    with pytest.raises(ValueError, match="cannot read integrity_key_file") as error:
        KVConnectorConfig(integrity_key_file=tmp_path / "missing").resolve_integrity_key()
    assert KEY.decode() not in str(error.value)


def test_without_a_key_the_tiers_warn_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.delenv(tier_config.INTEGRITY_KEY_ENV, raising=False)
    monkeypatch.setattr(tier_config, "_warned_unkeyed", False)
    with caplog.at_level(logging.WARNING, logger="mokv.tiers"):
        for _ in range(2):
            with make_manager(disk_offload_dir=tmp_path) as m:
                run_prompt(m, "a", PROMPT)
    assert sum("without an integrity key" in r.getMessage() for r in caplog.records) == 1


PASSWORD = "s3cret-pw"


def test_a_password_protected_server(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.DEBUG), RedisServer(tmp_path, "--requirepass", PASSWORD) as server:
        host = f"127.0.0.1:{server.port}/0"
        for url, why in ((f"redis://{host}", "refused the login"), (f"redis://:wrong-pw@{host}", "refused")):
            with pytest.raises(RemoteStoreError, match=why) as error:
                make_manager(remote_url=url)
            assert "wrong-pw" not in str(error.value)
        good = f"redis://:{PASSWORD}@{host}"
        with make_manager(remote_url=good) as first:
            run_prompt(first, "a", PROMPT)
        with make_manager(remote_url=good) as second:
            assert admit(second, "b", PROMPT).processed_length == 3 * PAGE_SIZE
            assert PASSWORD not in repr(second.get_tier_metrics()) + repr(second.get_tier_usage())
        report = GenerationConfig(remote_cache=good).report()
        assert report["remote_cache"] == f"redis://{host}" and PASSWORD not in repr(GenerationConfig(remote_cache=good))
    assert PASSWORD not in caplog.text


def test_an_acl_user_limited_to_mokv_keys(tmp_path: Path) -> None:
    user = ["--user", "kvcache", "on", ">kv-pass", "~mokv:*", "+@all"]
    with RedisServer(tmp_path, *user) as server:
        url = f"redis://kvcache:kv-pass@127.0.0.1:{server.port}/0"
        with make_manager(remote_url=url) as first:
            run_prompt(first, "a", PROMPT)
        with make_manager(remote_url=url) as second:
            assert admit(second, "b", PROMPT).processed_length == 3 * PAGE_SIZE
        with pytest.raises(RemoteStoreError, match="refused"):
            make_manager(remote_url=f"redis://kvcache:nope@127.0.0.1:{server.port}/0")
