"""`mokv chat`: an interactive conversation whose history stays in the paged
cache between turns, so each turn only prefills what is new."""

from __future__ import annotations

import click

from mokv import PagedKVCacheManager
from mokv_examples.generate import TokenStream, generation_options, make_config
from mokv_examples.pipeline import GenerationConfig, SmolLM2, generate, make_manager


@click.command()
@generation_options
@click.option("--system", default="You are a helpful assistant.", show_default=True, help="System prompt.")
def chat(system: str, **options) -> None:
    """Chat with SmolLM2-135M (an empty line or Ctrl-D ends the conversation)."""
    config = make_config(**options)
    model = SmolLM2()
    config.enable_prefix_caching = True
    with make_manager(model, config, max_batch_size=1) as manager:
        converse(model, manager, config, system)


def converse(model: SmolLM2, manager: PagedKVCacheManager, config: GenerationConfig, system: str) -> None:
    """Turns until an empty line or Ctrl-D."""
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
            model, [model.tokenizer.encode_chat(messages)], config, TokenStream(model), manager=manager
        )
        click.echo()
        after = manager.get_metrics_aggregated()
        reused = after.cache_tokens - before.cache_tokens
        click.echo(f"[{reused} of {len(request.prompt)} prompt tokens came from the cache]", err=True)
        messages.append(
            {"role": "assistant", "content": model.tokenizer.decode(request.generated, skip_special_tokens=True)}
        )
