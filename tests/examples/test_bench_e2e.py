"""The end-to-end benchmark's bookkeeping, without a model: the manager timer, the cache's
share of step time, the goal lines and the llama.cpp skip message."""

from __future__ import annotations

import sys
import time

from mokv_examples.bench import e2e_llama_cpp
from mokv_examples.bench.e2e_cache_cost import CacheCost, TimedManager
from mokv_examples.bench.e2e_engines import engines_markdown


class SlowManager:
    total_num_pages = 7

    def alloc(self, ctx: object) -> str:
        time.sleep(0.01)
        return "allocated"


def test_timed_manager_forwards_calls_and_adds_up_their_time():
    manager = TimedManager(SlowManager())
    assert manager.total_num_pages == 7
    assert manager.alloc(None) == "allocated" and manager.alloc(None) == "allocated"
    assert 0.02 <= manager.seconds < 0.5


def test_cache_share_counts_manager_calls_and_the_step_time_attention_adds():
    cost = CacheCost(model=None, without_cache=None)
    cost.step_seconds, cost.skipped_seconds = 10.0, 7.0
    assert cost.share(manager_seconds=2.0) == (2.0 + 3.0) / 12.0
    cost.skipped_seconds = 11.0  # noise can make the cache-free graph slower: no negative cost
    assert cost.share(manager_seconds=0.0) == 0.0


def test_goal_lines_compare_with_llama_cpp_batch_one():
    rows = [
        {"case": "decode-b1", "mokv_tokens_per_s": 120.0, "mokv_cache_share": 0.1, "llama.cpp_tokens_per_s": 100.0},
        {"case": "decode-b16", "mokv_tokens_per_s": 380.0, "mokv_cache_share": 0.1, "llama.cpp_tokens_per_s": None},
    ]
    text = engines_markdown(rows, ["mokv"], None)
    assert "| decode-b16 | 380.0 | – | 10% |" in text
    assert "decode-b1: mokv / llama.cpp decode-b1 = 1.20 (goal >= 1: met)" in text
    assert "decode-b16: mokv / llama.cpp decode-b1 = 3.80 (goal >= 4: not met)" in text


def test_missing_llama_cpp_is_a_skip_with_the_install_command(monkeypatch):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)
    reason = e2e_llama_cpp.unavailable_reason()
    assert reason is not None and "requirements-bench.txt" in reason
    rows = [{"case": "decode-b1", "mokv_tokens_per_s": 1.0, "mokv_cache_share": 0.1, "llama.cpp_tokens_per_s": None}]
    assert f"llama.cpp column skipped: {reason}" in engines_markdown(rows, ["mokv"], reason)
