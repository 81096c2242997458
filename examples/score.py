"""`mokv score`: teacher-forced log-probabilities of a text under SmolLM2.

The text is prefilled through the paged cache in chunks of `--token-budget` tokens with
every token's logits returned (the graph's `logit_rows` input selects them), so each token
after the first gets the log-probability the model gave it, the model's likeliest tokens at
its position, and the text a perplexity. `--against FORMAT` scores the same tokens with a
second weight format, `--against-kv-dtype KV` with the KV cache stored another way, and each
reports how often the top-1 tokens agree and the perplexity ratio: how a weight format's or
a KV format's own error is measured against float32.
"""

from __future__ import annotations

import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path

import click
import numpy as np
import numpy.typing as npt

from mokv_examples.logprobs import TokenLogprob, token_logprobs
from mokv_examples.options import kv_dtype_option, weights_option
from mokv_examples.pipeline import KV_DTYPES, GenerationConfig, SmolLM2
from mokv_models.weight_formats import WEIGHT_FORMATS


@dataclass
class ScoredText:
    """Log-probabilities of tokens 1..n-1 of `token_ids`, each given the tokens before it."""

    token_ids: list[int]
    scores: list[TokenLogprob]

    @property
    def mean_logprob(self) -> float:
        return float(np.mean([s.logprob for s in self.scores])) if self.scores else 0.0

    @property
    def perplexity(self) -> float:
        return math.exp(-self.mean_logprob)

    def top1(self) -> npt.NDArray[np.int64]:
        """The likeliest token at each scored position."""
        return np.array([s.top[0][0] for s in self.scores], np.int64)


def score_tokens(
    model: SmolLM2, token_ids: npt.NDArray[np.int64], top_k: int = 5, token_budget: int = 512, page_size: int = 16
) -> ScoredText:
    """Teacher-forced scores of `token_ids` (at least 2 tokens) through `model`'s paged cache."""
    ids = np.asarray(token_ids, np.int64)
    if len(ids) < 2:
        raise ValueError(f"scoring needs at least 2 tokens, got {len(ids)}")
    if token_budget < 1:
        raise ValueError(f"token_budget must be >= 1, got {token_budget}")
    config = GenerationConfig(page_size=page_size, num_pages=-(-len(ids) // page_size) + 1, enable_prefix_caching=False)
    manager = model.new_manager(config, max_batch_size=1)
    ctx = model.cache.context("score", ids)
    manager.claim(ctx.request_id)
    scores: list[TokenLogprob] = []
    try:
        for start in range(0, len(ids), token_budget):
            n = min(token_budget, len(ids) - start)
            manager.alloc(ctx)
            cache = manager.runtime_inputs_for_leaf([[ctx]])
            offsets = np.array([0, n], np.uint32)
            positions = np.arange(start, start + n, dtype=np.int64)
            logits = model.step(
                ids[start : start + n], offsets, positions, cache, logit_rows=np.arange(n, dtype=np.int64)
            )
            # Row i predicts token start + i + 1; the text's last token predicts nothing.
            targets = ids[start + 1 : start + n + 1]
            scores += token_logprobs(logits[: len(targets)], targets, top_k)
            if start + n < len(ids):
                ctx.skip_processing(n)
    finally:
        manager.release(ctx.request_id)
    return ScoredText(ids.tolist(), scores)


def agreement(a: ScoredText, b: ScoredText) -> dict[str, float]:
    """How two scorings of the same tokens differ: the share of positions whose likeliest
    token is the same, the largest gap between their log-probabilities of the text, and the
    ratio of their perplexities (b's over a's)."""
    if a.token_ids != b.token_ids:
        raise ValueError("the two scorings are of different tokens")
    gaps = np.abs(np.array([s.logprob for s in a.scores]) - np.array([s.logprob for s in b.scores]))
    return {
        "top1_agreement": float(np.mean(a.top1() == b.top1())),
        "max_logprob_gap": float(gaps.max()),
        "perplexity_ratio": b.perplexity / a.perplexity,
    }


@click.command()
@click.argument("text", required=False)
@click.option(
    "--file",
    "file_path",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="Score this file's text instead.",
)
@weights_option
@kv_dtype_option
@click.option(
    "--against", type=click.Choice(WEIGHT_FORMATS), help="Also score with this weight format and compare (e.g. f32)."
)
@click.option(
    "--against-kv-dtype",
    type=click.Choice(KV_DTYPES),
    help="Also score with the KV cache stored this way and compare (e.g. float32 against an 8-bit cache).",
)
@click.option(
    "--key-rotation/--no-key-rotation",
    default=True,
    show_default=True,
    help="Store an 8-bit cache's keys Hadamard-rotated (KVCacheQuantConfig.rotate_keys).",
)
@click.option("--top-k", default=5, show_default=True, help="Likeliest tokens recorded per position.")
@click.option("--token-budget", default=512, show_default=True, help="Tokens per prefill step.")
@click.option("--show", "show_tokens", default=0, show_default=True, help="Print the first N scored tokens.")
@click.option(
    "--json", "json_path", type=click.Path(dir_okay=False, path_type=Path), help="Write every token's scores here."
)
def score(
    text: str | None,
    file_path: Path | None,
    weights: str,
    kv_dtype: str,
    against: str | None,
    against_kv_dtype: str | None,
    key_rotation: bool,
    top_k: int,
    token_budget: int,
    show_tokens: int,
    json_path: Path | None,
) -> None:
    """Log-probabilities, top-k and perplexity of TEXT (or --file) under SmolLM2-135M."""
    if (text is None) == (file_path is None):
        raise click.UsageError("give either TEXT or --file")
    text = file_path.read_text() if file_path is not None else text
    main_label = f"{weights} weights, {kv_dtype} KV"
    runs = {main_label: SmolLM2(weights=weights, kv_dtype=kv_dtype, rotate_keys=key_rotation)}
    session = runs[main_label].session
    for other_weights, other_kv in ((against, kv_dtype), (weights, against_kv_dtype)):
        label = f"{other_weights} weights, {other_kv} KV"
        if other_weights is not None and other_kv is not None and label not in runs:
            runs[label] = SmolLM2(session=session, weights=other_weights, kv_dtype=other_kv, rotate_keys=key_rotation)
    tokenizer = runs[main_label].tokenizer
    ids = tokenizer.encode(text)
    scored = {label: score_tokens(model, ids, top_k, token_budget) for label, model in runs.items()}
    main = scored[main_label]
    for i, s in enumerate(main.scores[:show_tokens]):
        alternatives = ", ".join(f"{tokenizer.decode([t])!r} {lp:.2f}" for t, lp in s.top)
        click.echo(f"{i + 1:5d} {tokenizer.decode([s.token_id])!r:>16} {s.logprob:8.3f}   top: {alternatives}")
    for label, result in scored.items():
        click.echo(
            f"{label}: {len(result.scores)} tokens scored, mean log-probability {result.mean_logprob:.4f}, "
            f"perplexity {result.perplexity:.3f}"
        )
    comparisons = {label: agreement(main, result) for label, result in scored.items() if label != main_label}
    for label, comparison in comparisons.items():
        click.echo(
            f"{main_label} vs {label}: top-1 agreement {comparison['top1_agreement']:.2%}, "
            f"perplexity ratio {comparison['perplexity_ratio']:.4f}, "
            f"largest log-probability gap {comparison['max_logprob_gap']:.3f}"
        )
    if json_path is not None:
        payload = {
            "token_ids": main.token_ids,
            "runs": {
                label: {
                    "perplexity": r.perplexity,
                    "mean_logprob": r.mean_logprob,
                    "scores": [s.as_json() for s in r.scores],
                }
                for label, r in scored.items()
            },
            "comparisons": comparisons,
        }
        json_path.write_text(json.dumps(payload))
        click.echo(f"wrote {json_path}", err=True)
    sys.stdout.flush()
