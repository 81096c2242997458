"""`mokv chat`: an interactive conversation whose history stays in the paged
cache between turns, so each turn only prefills what is new."""

from __future__ import annotations

from dataclasses import replace

import click

from mokv_examples.options import generation_options, make_config
from mokv_examples.pipeline import GenerationConfig, SmolLM2, generate
from mokv_examples.scheduler import CacheManager
from mokv_examples.streaming import TokenStream


@click.command()
@generation_options
@click.option("--system", default="You are a helpful assistant.", show_default=True, help="System prompt.")
def chat(system: str, **options) -> None:
    """Chat with SmolLM2-135M (an empty line or Ctrl-D ends the conversation)."""
    weights, kv_dtype = options.pop("weights"), options.pop("kv_dtype")
    config = replace(make_config(**options), enable_prefix_caching=True)
    model = SmolLM2(weights=weights, kv_dtype=kv_dtype)
    manager = model.new_manager(config, max_batch_size=1)
    try:
        converse(model, manager, config, system)
    finally:
        manager.shutdown()


def converse(model: SmolLM2, manager: CacheManager, config: GenerationConfig, system: str) -> None:
    """Turns until an empty line or Ctrl-D."""

    def decode(ids: list[int]) -> str:
        return model.tokenizer.decode(ids, skip_special_tokens=True)

    messages = [{"role": "system", "content": system}]
    while True:
        try:
            user = click.prompt("you", default="", show_default=False, prompt_suffix="> ")
        except click.Abort:
            break
        if not user.strip():
            break
        messages.append({"role": "user", "content": user})
        before = manager.get_metrics_aggregated()
        click.echo("assistant> ", nl=False)
        (request,), _, _ = generate(
            model, [model.tokenizer.encode_chat(messages)], config, TokenStream(decode), manager=manager
        )
        click.echo()
        after = manager.get_metrics_aggregated()
        reused = after.cache_tokens - before.cache_tokens
        click.echo(f"[{reused} of {len(request.prompt)} prompt tokens came from the cache]", err=True)
        messages.append({"role": "assistant", "content": decode(request.generated)})
