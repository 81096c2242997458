"""`mokv generate`: SmolLM2 completing prompts with continuous batching and
prefix caching on mokv's paged cache."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from mokv_examples.pipeline import GenerationConfig, SmolLM2, run_prompts
from mokv_examples.scheduler import Request

DEFAULT_PROMPTS = (
    "What is the capital of France?",
    "Write a haiku about caching.",
    "Explain what a KV cache is in one sentence.",
)


def generation_options(command):
    """The cache and sampling options shared by `generate` and `chat`."""
    for option in reversed(
        [
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


class TokenStream:
    """Prints one request's text as it grows (decoding the whole tail each time,
    so multi-token characters come out whole)."""

    def __init__(self, model: SmolLM2) -> None:
        self.model = model
        self.printed = 0

    def __call__(self, request: Request, token: int) -> None:
        text = self.model.tokenizer.decode(request.generated, skip_special_tokens=True)
        sys.stdout.write(text[self.printed :])
        sys.stdout.flush()
        self.printed = len(text)


@click.command()
@click.argument("prompts", nargs=-1)
@generation_options
@click.option("--chat/--no-chat", default=True, show_default=True, help="Wrap prompts in the model's chat template.")
@click.option(
    "--json",
    "json_path",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Write prompts, token ids, texts and statistics here.",
)
def generate(prompts: tuple[str, ...], chat: bool, json_path: Path | None, **options) -> None:
    """Complete PROMPTS (default: three demo prompts) with SmolLM2-135M."""
    prompts = prompts or DEFAULT_PROMPTS
    config = make_config(**options)
    model = SmolLM2()
    if len(prompts) == 1:
        report = run_prompts(model, prompts, config, chat, on_token=TokenStream(model))
        click.echo()
    else:
        with click.progressbar(length=len(prompts) * config.max_new_tokens, label="generating", file=sys.stderr) as bar:
            report = run_prompts(model, prompts, config, chat, on_token=lambda r, t: bar.update(1))
        for completion in report.completions:
            click.echo(f"\n>>> {completion.prompt}\n{completion.text.strip()}")
    summary = report.summary()
    click.echo(
        f"\n{summary['requests']} requests: prefill {summary['prefill_tokens']} tokens at "
        f"{summary['prefill_tokens_per_s']:.0f} tok/s, decode {summary['decode_tokens']} tokens at "
        f"{summary['decode_tokens_per_s']:.1f} tok/s, prefix hit rate {summary['prefix_hit_rate']:.1%}, "
        f"peak pages used {summary['peak_pages_used']}/{config.num_pages}, "
        f"{summary['preemptions']} preemptions, {summary['wall_seconds']:.1f} s",
        err=True,
    )
    if json_path is not None:
        payload = {
            "requests": [vars(c) for c in report.completions],
            "config": config.report(),
            "stats": summary,
        }
        json_path.write_text(json.dumps(payload, indent=1))
        click.echo(f"wrote {json_path}", err=True)
