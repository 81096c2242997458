"""How much of an 8-bit KV format's scoring error is the format's own, measured without mokv's kernels.

Runs SmolLM2 through the float64 numpy forward (`mokv_reference.numpy_llama`) twice per case:
exact, and with the keys, the values or both replaced by what an 8-bit cache hands back
(`mokv_reference.lossy_kv`: one scale per token and KV head, keys rotated by the Hadamard
matrix first, as the pipeline's default `KVCacheQuantConfig(rotate_keys=True)` stores them).
It prints, per case, the top-1 agreement with the exact forward and the change in perplexity
over the first `--tokens` tokens of `--file`. No Mojo kernel runs, so where these figures equal
`mokv score --kv-dtype F --against-kv-dtype float32`'s, what is left is the format's error.

Run: .venv/bin/python tools/kv_format_error.py [--file README.md] [--tokens 2048]
(about a minute per case at 2,048 tokens on 2 cores).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

from mokv_examples.logprobs import log_softmax
from mokv_models.gguf_model import load_llama
from mokv_models.tokenizer import load_tokenizer
from mokv_reference.lossy_kv import PARTS, eight_bit_store
from mokv_reference.numpy_llama import KVStore, numpy_llama_logits

FORMATS = ("float8_e4m3fn", "int8")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--file", type=Path, default=Path(__file__).parents[1] / "README.md")
    parser.add_argument("--tokens", type=int, default=2048, help="first tokens of the file to score")
    parser.add_argument("--formats", default=",".join(FORMATS))
    args = parser.parse_args()
    checkpoint = load_llama(weights="f32")
    tokens = np.asarray(load_tokenizer().encode(args.file.read_text())[: args.tokens])
    targets = tokens[1:]

    def run(name: str, kv_store: KVStore | None) -> tuple[np.ndarray, float]:
        """Each position's likeliest next token, and the text's mean negative log-likelihood."""
        started = time.perf_counter()
        logits = numpy_llama_logits(checkpoint, tokens, kv_store)[:-1]
        print(f"  {name}: {time.perf_counter() - started:.0f} s", file=sys.stderr, flush=True)
        return logits.argmax(axis=-1), float(-log_softmax(logits)[np.arange(len(targets)), targets].mean())

    exact_top, exact_nll = run("exact", None)
    print(f"{args.file.name}, first {len(tokens)} tokens; against the exact float64 forward\n")
    print("| format | stored in 8 bits | top-1 agreement | perplexity change |")
    print("|---|---|---|---|")
    for fmt in args.formats.split(","):
        for part in PARTS:
            top, nll = run(f"{fmt} {part}", eight_bit_store(fmt, checkpoint.config.head_dim, part))
            agreement = (top == exact_top).mean()
            print(f"| {fmt} | {part} | {100 * agreement:.2f}% | {100 * np.expm1(nll - exact_nll):+.2f}% |", flush=True)


if __name__ == "__main__":
    main()
