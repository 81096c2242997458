"""`mokv generate`: SmolLM2 completing prompts with continuous batching and
prefix caching on mokv's paged cache, answers shown as they are generated
(`streaming.py` says how)."""

from __future__ import annotations

import json
from pathlib import Path

import click

from mokv_examples.options import generation_options, make_config
from mokv_examples.pipeline import SmolLM2, request_id, run_prompts
from mokv_examples.streaming import answer_display

DEFAULT_PROMPTS = (
    "What is the capital of France?",
    "Write a haiku about caching.",
    "Explain what a KV cache is in one sentence.",
)


@click.command()
@click.argument("prompts", nargs=-1)
@generation_options
@click.option("--chat/--no-chat", default=True, show_default=True, help="Wrap prompts in the model's chat template.")
@click.option(
    "--logprobs",
    default=0,
    show_default=True,
    help="Record each generated token's log-probability and its N likeliest alternatives (in --json).",
)
@click.option(
    "--json",
    "json_path",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Write prompts, token ids, texts and statistics here.",
)
def generate(
    prompts: tuple[str, ...],
    chat: bool,
    logprobs: int,
    json_path: Path | None,
    weights: str,
    kv_dtype: str,
    **options,
) -> None:
    """Complete PROMPTS (default: three demo prompts) with SmolLM2-135M."""
    prompts = prompts or DEFAULT_PROMPTS
    config = make_config(**options)
    model = SmolLM2(weights=weights, kv_dtype=kv_dtype)

    def decode(ids: list[int]) -> str:
        return model.tokenizer.decode(ids, skip_special_tokens=True)

    display = answer_display(prompts, [request_id(i) for i in range(len(prompts))], decode)
    report = run_prompts(model, prompts, config, chat, on_token=display, logprobs=logprobs)
    if len(prompts) == 1:
        click.echo()
    summary = report.summary()
    click.echo(
        f"\n{summary['requests']} requests ({weights} weights, {kv_dtype} KV): "
        f"time to first token {summary['time_to_first_token_s']:.2f} s "
        f"(mean; longest {summary['max_time_to_first_token_s']:.2f} s), "
        f"decode {summary['decode_tokens_per_s']:.1f} tok/s "
        f"({summary['decode_tokens']} tokens), prefill {summary['prefill_tokens_per_s']:.0f} tok/s "
        f"({summary['prefill_tokens']} tokens), prefix hit rate {summary['prefix_hit_rate']:.1%}, "
        f"peak pages {summary['peak_pages_used']}/{config.num_pages}, {summary['preemptions']} preemptions, "
        f"{summary['wall_seconds']:.1f} s",
        err=True,
    )
    if json_path is not None:
        payload = {
            "requests": [vars(c) for c in report.completions],
            "config": {**config.report(), "weights": weights, "kv_dtype": kv_dtype, "logprobs": logprobs},
            "stats": summary,
        }
        json_path.write_text(json.dumps(payload, indent=1))
        click.echo(f"wrote {json_path}", err=True)
