"""SmolLM2 test constants and helpers shared by the model tests and the GPU tests:
the prompts, the paged/dense tolerances, the graphs they compile together, and the dense
graph's greedy reference."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from max.driver import Buffer, Device
from max.engine import Model
from max.graph import DeviceRef

from mokv.graph import GraphGroup
from mokv_examples.pipeline import KV_DTYPES, MokvCache, pipeline_graph
from mokv_models.attention_backends import DenseCausalAttention
from mokv_models.gguf_model import LlamaCheckpoint
from mokv_models.llama import build_llama_graph, ragged_batch
from mokv_models.tokenizer import GGUFTokenizer
from mokv_models.weight_formats import WEIGHT_FORMATS

DEFAULT_FORMAT = WEIGHT_FORMATS[0]
CPU_REF = DeviceRef.CPU()
Greedy = Callable[[np.ndarray, int], list[int]]
NEW_TOKENS = 32
# Paged and dense logits differ only by the two attention kernels' summation orders.
PAGED_LOGIT_ATOL, PAGED_LOGIT_RTOL = 2e-3, 1e-3
SYSTEM = "You are a careful assistant. Answer briefly and precisely, in plain English."
QUESTIONS = [
    "What is the capital of France?",
    "List three prime numbers.",
    "Why is the sky blue? Explain it to a child who has just asked you on a sunny afternoon walk.",
]


def dense_and_paged_graphs(
    checkpoint: LlamaCheckpoint,
    group: GraphGroup,
    device: DeviceRef = CPU_REF,
    kv_dtypes: tuple[str, ...] = (KV_DTYPES[0],),
) -> str:
    """The dense (no-cache) graph and a pipeline on mokv's paged cache per KV dtype, built
    into `group` on `device`; returns the dense graph's name."""
    dense = build_llama_graph(
        checkpoint.config,
        DenseCausalAttention(),
        checkpoint.encodings,
        f"llama_dense_{checkpoint.weight_format}" + ("" if device == CPU_REF else f"_{device.device_type}"),
        device,
        group,
    )
    for kv_dtype in kv_dtypes:
        pipeline_graph(checkpoint, MokvCache(), kv_dtype, device_ref=device, group=group)
    return dense.name


def dense_greedy_fn(
    dense: Model, checkpoint: LlamaCheckpoint, tokenizer: GGUFTokenizer, device: Device | None = None
) -> Callable[[np.ndarray, int], list[int]]:
    """``f(prompt, n)``: the first ``n`` greedy tokens of ``prompt`` (fewer if a stop token
    comes first) from the dense graph ``dense`` on ``device`` (the CPU unless given),
    recomputing the whole sequence every step with no cache. Memoised per prompt, extended
    on demand, so tests comparing against the same prompts share the work."""
    memo: dict[tuple[int, ...], list[int]] = {}
    stop_ids = tokenizer.stop_token_ids

    def greedy(prompt: np.ndarray, n: int) -> list[int]:
        out = memo.setdefault(tuple(prompt.tolist()), [])
        while len(out) < n and not (out and out[-1] in stop_ids):
            tokens = np.concatenate([prompt, np.asarray(out, np.int64)])
            batch = ragged_batch([tokens], context_length=checkpoint.config.context_length)
            inputs = [Buffer.from_numpy(a) for a in batch.inputs()]
            if device is not None:
                inputs = [b.to(device) for b in inputs]
            (logits,) = dense.execute(*inputs)
            out.append(int(np.argmax(logits.to_numpy()[0])))
        return out[:n]

    return greedy


def logprob_tolerance(dense_logits: np.ndarray) -> np.ndarray:
    """Per row of logits, how far a paged log-probability may be from the dense one when
    every logit is within the paged/dense logit tolerance: a log-softmax entry moves by at
    most its own logit's change plus the log-sum-exp's, which is at most the largest change
    of any logit, so by at most twice the largest logit change."""
    return 2 * (PAGED_LOGIT_ATOL + PAGED_LOGIT_RTOL * np.abs(dense_logits).max(axis=-1))
