"""The demo workload's prompts: one system prompt shared by several questions, so that the
prefix cache has something to share (`mokv inspect`, `mokv bench e2e`, `mokv bench tiers`)."""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from mokv_models.tokenizer import GGUFTokenizer

SYSTEM_PROMPT = (
    "You are a concise assistant for a systems engineering team. Answer in one or two "
    "sentences, prefer concrete numbers, and say so when you are unsure."
)
QUESTIONS = (
    "What is a page table?",
    "Why do LLM servers cache keys and values?",
    "What does prefix caching save?",
    "What is continuous batching?",
    "Name one way to reduce memory use during inference.",
)


def system_chat(tokenizer: GGUFTokenizer, question: str) -> npt.NDArray[np.int64]:
    """`question` after the shared system prompt, in the model's chat template."""
    return tokenizer.encode_chat([{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": question}])


def chat_prompts(tokenizer: GGUFTokenizer, n: int) -> list[npt.NDArray[np.int64]]:
    """`n` chat prompts sharing the system prompt, each with its own numbered question."""
    return [system_chat(tokenizer, f"{QUESTIONS[i % len(QUESTIONS)]} (#{i})") for i in range(n)]


def long_prompt(tokenizer: GGUFTokenizer, tokens: int) -> npt.NDArray[np.int64]:
    """A prompt of exactly `tokens` tokens of plain English."""
    text = " ".join(f"{SYSTEM_PROMPT} Question {i}: {QUESTIONS[i % len(QUESTIONS)]}" for i in range(64))
    ids = tokenizer.encode(text)
    if len(ids) < tokens:
        raise ValueError(f"the long prompt has only {len(ids)} tokens, fewer than the {tokens} asked for")
    return ids[:tokens]
