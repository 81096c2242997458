"""`mokv generate`: SmolLM2 completing prompts with continuous batching and
prefix caching on mokv's paged cache, answers shown as they are generated
(`streaming.py` says how)."""

from __future__ import annotations

import json
from pathlib import Path

import click

from mokv_examples.pipeline import KV_DTYPES, GenerationConfig, SmolLM2, request_id, run_prompts
from mokv_examples.streaming import answer_display
from mokv_models.weight_formats import WEIGHT_FORMATS

DEFAULT_PROMPTS = (
    "What is the capital of France?",
    "Write a haiku about caching.",
    "Explain what a KV cache is in one sentence.",
)


def _choice_option(name: str, choices: tuple[str, ...], help: str):
    """An option taking one of `choices`, the first by default."""
    return click.option(name, type=click.Choice(choices), default=choices[0], show_default=True, help=help)


weights_option = _choice_option(
    "--weights",
    WEIGHT_FORMATS,
    "gguf: the GGUF's own Q4_1/Q8_0 blocks, dequantized in registers by mokv's kernels; "
    "f32: the weights dequantized to float32 once (the reference).",
)
"""`--weights`: the weight format of the model graph."""

kv_dtype_option = _choice_option(
    "--kv-dtype",
    KV_DTYPES,
    "KV cache storage: float32, bfloat16, or 8-bit codes with a float32 scale per token and KV head "
    "(float8_e4m3fn, int8: a quarter of float32's memory).",
)
"""`--kv-dtype`: how the KV cache stores keys and values."""


def generation_options(command):
    """The model, cache and sampling options shared by `generate` and `chat`."""
    for option in reversed(
        [
            weights_option,
            kv_dtype_option,
            click.option("--max-new-tokens", default=64, show_default=True, help="Tokens to generate per prompt."),
            click.option("--temperature", default=0.0, show_default=True, help="0 is greedy and deterministic."),
            click.option("--seed", default=0, show_default=True, help="Sampling seed (temperature > 0)."),
            click.option("--page-size", default=16, show_default=True, help="Tokens per KV cache page."),
            click.option("--num-pages", default=512, show_default=True, help="Pages in the KV cache."),
            click.option("--prefix-caching/--no-prefix-caching", default=True, show_default=True),
            click.option("--max-batch-size", default=16, show_default=True, help="Most requests per step."),
            click.option(
                "--token-budget", default=512, show_default=True, help="Most tokens per step (chunked prefill)."
            ),
            click.option("--cache-salt", help="Share cached KV only with requests of this salt (a tenant id)."),
        ]
    ):
        command = option(command)
    return tier_options(command)


def tier_options(command):
    """The KV tiers under the device cache: `--host-cache-pages`, `--disk-cache`,
    `--remote-cache` (the integrity key of the shared ones comes from
    MOKV_KV_INTEGRITY_KEY)."""
    disk_help = "Directory of a disk KV tier: shared by processes, kept across runs."
    remote_help = "redis://[user:password@]host:port/db (or rediss://) of a remote KV tier."
    for option in reversed(
        [
            click.option("--host-cache-pages", default=0, show_default=True, help="Pages of a host-memory KV tier."),
            click.option("--disk-cache", type=click.Path(file_okay=False), help=disk_help),
            click.option("--remote-cache", metavar="URL", help=remote_help),
        ]
    ):
        command = option(command)
    return command


def make_config(**options) -> GenerationConfig:
    return GenerationConfig(
        max_new_tokens=options["max_new_tokens"],
        temperature=options["temperature"],
        seed=options["seed"],
        page_size=options["page_size"],
        num_pages=options["num_pages"],
        enable_prefix_caching=options["prefix_caching"],
        max_batch_size=options["max_batch_size"],
        token_budget=options["token_budget"],
        host_pages=options["host_cache_pages"],
        cache_salt=options["cache_salt"],
        disk_cache=options["disk_cache"],
        remote_cache=options["remote_cache"],
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
