"""llama.cpp (through llama-cpp-python) on the same GGUF, for `mokv bench e2e
--against-llama-cpp`: the yardstick for mokv's SmolLM2 pipeline.

llama-cpp-python is an optional benchmark extra (`INSTALL_HINT`; it builds llama.cpp from
source), never part of `make test`.
It runs with as many threads as the machine has cores (2 here), on the token ids mokv's
tokenizer produced, greedy like mokv's runs.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np
import numpy.typing as npt

INSTALL_HINT = "pip install -r requirements-bench.txt (builds llama.cpp from source, about 8 minutes on 2 cores)"

SPIN_DOWN_SECONDS = 2.5
"""How long to let this process's MAX worker threads go idle before timing llama.cpp.
They spin-wait for a while after a graph runs, which would take the cores llama.cpp's
threads need."""


def unavailable_reason() -> str | None:
    """Why llama.cpp cannot run here, or None when it can."""
    try:
        import llama_cpp  # noqa: F401
    except ImportError as error:
        return f"llama-cpp-python is not installed ({error}); {INSTALL_HINT}"
    return None


class LlamaCpp:
    """One llama.cpp context over `gguf_path`."""

    def __init__(self, gguf_path: Path, threads: int | None = None, context_length: int = 2048) -> None:
        from llama_cpp import Llama

        self.threads = threads or os.cpu_count() or 1
        self.llm = Llama(
            model_path=str(gguf_path),
            n_threads=self.threads,
            n_threads_batch=self.threads,
            n_ctx=context_length,
            n_batch=512,
            verbose=False,
        )

    def prefill_seconds(self, prompt: npt.NDArray[np.int64]) -> float:
        """Seconds to evaluate `prompt` from an empty context."""
        self.llm.reset()
        started = time.perf_counter()
        self.llm.eval(prompt.tolist())
        return time.perf_counter() - started

    def decode(self, prompt: npt.NDArray[np.int64], new_tokens: int) -> tuple[list[int], float]:
        """Greedy tokens after `prompt` and the seconds spent producing all but the first
        (which comes out of the prefill), as mokv counts decode time."""
        self.prefill_seconds(prompt)
        tokens = [self._greedy()]
        started = time.perf_counter()
        for _ in range(new_tokens - 1):
            self.llm.eval([tokens[-1]])
            tokens.append(self._greedy())
        return tokens, time.perf_counter() - started

    def _greedy(self) -> int:
        """The likeliest next token, from the logits of the last token evaluated (the
        high-level `scores` array is left empty unless every row's logits are kept)."""
        import llama_cpp

        logits = llama_cpp.llama_get_logits_ith(self.llm.ctx, -1)
        return int(np.argmax(np.ctypeslib.as_array(logits, shape=(self.llm.n_vocab(),))))
