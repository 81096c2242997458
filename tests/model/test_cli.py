"""The `mokv generate`, `chat` and `inspect` commands end to end on the session's compiled
SmolLM2 (patched in, so the CLI does not compile the graph a second time): what they
write must agree with the tokenizer and with a no-cache greedy recomputation."""

from __future__ import annotations

import json

import numpy as np
import pytest
from click.testing import CliRunner

from mokv_examples import chat as chat_module
from mokv_examples import generate as generate_module
from mokv_examples import inspect_cache
from mokv_examples import score as score_module
from mokv_examples.cli import main
from mokv_examples.logprobs import log_softmax
from mokv_examples.pipeline import GenerationConfig
from mokv_examples.prompts import QUESTIONS, system_chat
from mokv_models.llama import ragged_batch
from tests.support.smollm2 import DEFAULT_FORMAT, logprob_tolerance

PROMPTS = ["What is the capital of France?", "Name a prime number."]
NEW_TOKENS = 8


@pytest.fixture
def cli(monkeypatch, paged_models):
    """The CLI with its models taken from the session's compiled ones."""

    def compiled(session=None, weights=DEFAULT_FORMAT, **_):
        return paged_models(weights)

    for module in (chat_module, generate_module, inspect_cache, score_module):
        monkeypatch.setattr(module, "SmolLM2", compiled)
    return CliRunner()


def test_generate_json_matches_tokenizer_and_greedy_reference(cli, tmp_path, smollm2_tokenizer, dense_greedy):
    out = tmp_path / "run.json"
    result = cli.invoke(
        main, ["generate", *PROMPTS, "--max-new-tokens", str(NEW_TOKENS), "--temperature", "0", "--json", str(out)]
    )
    assert result.exit_code == 0, result.output
    run = json.loads(out.read_text())
    assert [r["prompt"] for r in run["requests"]] == PROMPTS
    for prompt, request in zip(PROMPTS, run["requests"], strict=True):
        ids = smollm2_tokenizer.encode_chat([{"role": "user", "content": prompt}])
        assert request["prompt_token_ids"] == ids.tolist()
        assert request["token_ids"] == dense_greedy(ids, NEW_TOKENS)
        assert request["text"] == smollm2_tokenizer.decode(request["token_ids"], skip_special_tokens=True)
        assert request["text"].strip() in result.output
    stats = run["stats"]
    generated = sum(len(r["token_ids"]) for r in run["requests"])
    # Each request's first token comes out of its prefill step; the rest are decodes.
    assert stats["decode_tokens"] == generated - len(PROMPTS)
    assert stats["prefill_tokens"] == sum(len(r["prompt_token_ids"]) for r in run["requests"])
    assert stats["prefill_tokens_per_s"] > 0 and stats["decode_tokens_per_s"] > 0
    assert 0 < stats["time_to_first_token_s"] <= stats["max_time_to_first_token_s"] < stats["wall_seconds"]
    assert "time to first token" in result.output


def test_generate_logprobs_are_the_dense_graphs(cli, tmp_path, smollm2_tokenizer, dense_models, smollm2):
    """`--logprobs 3`: each greedy token is the likeliest of its 3 alternatives, and its
    log-probability is the dense graph's for that position."""
    out = tmp_path / "run.json"
    prompt = PROMPTS[0]
    result = cli.invoke(main, ["generate", prompt, "--max-new-tokens", "4", "--logprobs", "3", "--json", str(out)])
    assert result.exit_code == 0, result.output
    (request,) = json.loads(out.read_text())["requests"]
    ids = request["prompt_token_ids"] + request["token_ids"]
    batch = ragged_batch([np.array(ids)], context_length=smollm2.config.context_length, all_logits=True)
    logits = dense_models(DEFAULT_FORMAT).execute(*batch.inputs())[0].to_numpy()
    dense, tolerance = log_softmax(logits), logprob_tolerance(logits)
    first = len(request["prompt_token_ids"]) - 1
    for i, (token, scores) in enumerate(zip(request["token_ids"], request["logprobs"], strict=True)):
        assert scores["token_id"] == token and scores["top"][0][0] == token and len(scores["top"]) == 3
        assert abs(scores["logprob"] - dense[first + i, token]) <= tolerance[first + i]


def test_score_compares_weight_formats(cli, tmp_path):
    out = tmp_path / "score.json"
    text = "The cat sat on the mat. It was a sunny day, and the cat was happy."
    result = cli.invoke(main, ["score", text, "--against", "f32", "--show", "3", "--json", str(out)])
    assert result.exit_code == 0, result.output
    run = json.loads(out.read_text())
    labels = {f"{DEFAULT_FORMAT} weights, float32 KV", "f32 weights, float32 KV"}
    assert set(run["runs"]) == labels
    (comparison,) = run["comparisons"].values()
    assert comparison["top1_agreement"] >= 0.8
    assert comparison["perplexity_ratio"] == pytest.approx(
        run["runs"]["f32 weights, float32 KV"]["perplexity"]
        / run["runs"][f"{DEFAULT_FORMAT} weights, float32 KV"]["perplexity"]
    )
    for label, scored in run["runs"].items():
        assert len(scored["scores"]) == len(run["token_ids"]) - 1
        assert f"{label}: {len(scored['scores'])} tokens scored" in result.output
    assert "top-1 agreement" in result.output


def test_inspect_snapshot_shares_the_system_prompt_pages(paged_smollm2):
    config = GenerationConfig(max_new_tokens=2, page_size=16, num_pages=256)
    snapshot, manager = inspect_cache.fullest_snapshot(paged_smollm2, config)
    hit_rate = manager.get_metrics_aggregated().cache_hit_rate
    prompts = [system_chat(paged_smollm2.tokenizer, q) for q in QUESTIONS]
    shortest = min(len(p) for p in prompts)
    common = int(np.argmax(np.any(np.stack([p[:shortest] for p in prompts]) != prompts[0][:shortest], axis=0)))
    full_pages = common // 16
    assert full_pages > 0 and len(snapshot.request_ids) == len(prompts) - 1
    heads = {tuple(pages[:full_pages]) for pages in snapshot.pages}
    assert len(heads) == 1, "every request should map the shared prefix to the same pages"
    sharing = snapshot.sharing()
    assert all(sharing[page] == len(snapshot.request_ids) for page in next(iter(heads)))
    assert 0 < hit_rate < 1


def test_inspect_writes_a_png_and_shows_each_tier(cli, tmp_path):
    out = tmp_path / "cache.png"
    args = ["inspect", "--out", str(out), "--max-new-tokens", "2", "--host-cache-pages", "8"]
    result = cli.invoke(main, [*args, "--disk-cache", str(tmp_path / "kv")])
    assert result.exit_code == 0, result.output
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "of them shared" in result.output
    assert "  host: 0/8 pages" in result.output  # nothing was evicted
    stored = int(result.output.split("  disk: ")[1].split("/")[0])
    assert stored > 0 and stored == len(list((tmp_path / "kv").rglob("*.kvpage")))


def test_generate_warm_restarts_from_the_disk_cache(cli, tmp_path):
    runs = []
    for run in ("first", "second"):
        out = tmp_path / f"{run}.json"
        args = ["generate", *PROMPTS, "--max-new-tokens", "4", "--disk-cache", str(tmp_path / "kv"), "--json", str(out)]
        result = cli.invoke(main, args)
        assert result.exit_code == 0, result.output
        runs.append(json.loads(out.read_text()))
    first, second = runs
    # The second process-like run finds every full page of both prompts on disk
    # and generates the same tokens from the restored KV.
    assert [r["token_ids"] for r in second["requests"]] == [r["token_ids"] for r in first["requests"]]
    cacheable = sum((len(r["prompt_token_ids"]) - 1) // 16 * 16 for r in first["requests"])
    assert first["stats"]["prefill_tokens"] - second["stats"]["prefill_tokens"] == cacheable > 0


def test_chat_second_turn_reuses_the_first_from_the_cache(cli):
    result = cli.invoke(main, ["chat", "--max-new-tokens", "6"], input="Hi there!\nAnd again?\n\n")
    assert result.exit_code == 0, result.output
    reuse = [line for line in result.output.splitlines() if "prompt tokens came from the cache" in line]
    assert len(reuse) == 2, result.output
    first_reused, second_reused = (int(line.split("[")[1].split()[0]) for line in reuse)
    first_prompt = int(reuse[0].split(" of ")[1].split()[0])
    assert first_reused == 0
    # Every full page of the first turn's prompt is found again in the second.
    assert second_reused >= first_prompt // 16 * 16 > 0


def test_cache_salt_keeps_runs_apart_on_the_disk_cache(cli, tmp_path):
    def prefilled(salt: str) -> int:
        out = tmp_path / f"{salt}.json"
        args = ["generate", PROMPTS[0], "--max-new-tokens", "2", "--disk-cache", str(tmp_path / "kv")]
        result = cli.invoke(main, [*args, "--cache-salt", salt, "--json", str(out)])
        assert result.exit_code == 0, result.output
        return json.loads(out.read_text())["stats"]["prefill_tokens"]

    alice = prefilled("alice")
    assert prefilled("bob") == alice  # bob computes everything again
    assert prefilled("alice") < alice  # alice's second run reuses her pages
