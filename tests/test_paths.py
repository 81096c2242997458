"""Where mokv caches: `$MOKV_CACHE_DIR`, else the user's XDG cache, else ~/.cache/mokv;
never next to the installed package."""

from __future__ import annotations

import pytest

from mokv.paths import CACHE_ENV, MODULAR_CACHE_ENV, cache_dir, keep_compiled_graphs_in_cache_dir


@pytest.fixture
def no_overrides(monkeypatch, tmp_path):
    monkeypatch.delenv(CACHE_ENV, raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    return monkeypatch


def test_default_is_per_user(no_overrides, tmp_path):
    assert cache_dir() == tmp_path / "home" / ".cache" / "mokv"


def test_xdg_cache_home_moves_it(no_overrides, tmp_path):
    no_overrides.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "xdg" / "mokv"


@pytest.mark.parametrize("xdg", ["", "relative/xdg"])
def test_an_empty_or_relative_xdg_cache_home_is_ignored(no_overrides, tmp_path, xdg):
    no_overrides.setenv("XDG_CACHE_HOME", xdg)
    assert cache_dir() == tmp_path / "home" / ".cache" / "mokv"


def test_mokv_cache_dir_wins(no_overrides, tmp_path):
    no_overrides.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    no_overrides.setenv(CACHE_ENV, str(tmp_path / "mine"))
    assert cache_dir() == tmp_path / "mine"


def test_a_relative_mokv_cache_dir_is_taken_from_the_working_directory(no_overrides, tmp_path):
    no_overrides.chdir(tmp_path)
    no_overrides.setenv(CACHE_ENV, "here")
    assert cache_dir() == tmp_path / "here"


def test_compiled_graphs_follow_the_cache_unless_max_s_is_set(monkeypatch, tmp_path):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    monkeypatch.delenv(MODULAR_CACHE_ENV, raising=False)
    assert keep_compiled_graphs_in_cache_dir() == tmp_path / "modular"
    monkeypatch.setenv(MODULAR_CACHE_ENV, str(tmp_path / "theirs"))
    assert keep_compiled_graphs_in_cache_dir() == tmp_path / "theirs"
