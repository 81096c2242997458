"""The click options the user commands share: the model's weight format and KV storage, the
cache and sampling settings of `mokv generate` and `mokv chat`, and the KV tiers (also taken by
`mokv inspect` and `mokv bench e2e`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import click

from mokv_examples.pipeline import KV_DTYPES, GenerationConfig
from mokv_models.weight_formats import WEIGHT_FORMATS

F = TypeVar("F", bound=Callable[..., Any])


def _choice_option(name: str, choices: tuple[str, ...], help: str) -> Callable[[F], F]:
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


def generation_options(command: F) -> F:
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


def tier_options(command: F) -> F:
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


def make_config(**options: Any) -> GenerationConfig:
    """The `GenerationConfig` of `generation_options`' values (all but `--weights` and `--kv-dtype`)."""
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
