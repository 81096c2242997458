"""mokv inside MAX's own pipeline on a GPU: MAX's Llama (bfloat16 SmolLM2 weights, MAX's
matmuls, sampler and scheduler) with mokv's attention, kernels and manager, against the
same pipeline on MAX's own cache and kernels, on the same GPU.

Both run in bfloat16, with different attention kernels (mokv's tensor-core decode and
prefill, MAX's `flash_attention_ragged`), so their logits differ by bfloat16's rounding
carried through 30 layers, not bit for bit: the next-token logits after the prompts must
agree within `BF16_LOGIT_ATOL`, a bound a cache read at the wrong pages or positions
breaks by the logits' own magnitude (~20-30), and so must each prompt's first token where
MAX's own top two are further apart than that. No GPU has run this file yet: its first
run reports the measured difference, which sets the bound."""

from __future__ import annotations

import numpy as np
import pytest
from max.driver import DeviceSpec
from max.pipelines.architectures.llama3 import llama_arch

from mokv.pipelines import architecture
from mokv.pipelines.scheduler_manager import SchedulerKVCacheManager
from mokv_examples.max_model import ensure_model_dir
from tests.support.gpu import needs_gpu
from tests.support.max_generate import GreedyRun, chat_batches, greedy_run, pipeline_config

pytestmark = needs_gpu("MAX's Llama pipeline on mokv's cache and kernels against MAX's own, in bfloat16")

WEIGHTS = "bfloat16"
BF16_LOGIT_ATOL = 1.0
"""How far two bfloat16 attention kernels may move SmolLM2's next-token logits (a guess
until a GPU measures it: bfloat16 keeps 8 bits, each layer's attention output rounds)."""
FLOAT8_LOGIT_ATOL = 2.5 + BF16_LOGIT_ATOL
"""A float8 cache's bound on the CPU against float32 (`tests/pipelines/test_max_generate.py`),
plus bfloat16's."""


def _run(arch: object, **flags: str) -> GreedyRun:
    config = pipeline_config(ensure_model_dir(WEIGHTS), WEIGHTS, DeviceSpec.accelerator(), **flags)
    return greedy_run(arch, config, chat_batches())


@pytest.fixture(scope="module")
def maxs_run() -> GreedyRun:
    return _run(llama_arch)


def _tokens(run: GreedyRun) -> np.ndarray:
    """Every row's greedy tokens, both batches, `[rows, NEW_TOKENS]`."""
    return np.concatenate([np.asarray(batch) for batch in run.tokens])


def _agree(ours: GreedyRun, theirs: GreedyRun, atol: float) -> None:
    """Next-token logits within `atol` of MAX's; the first tokens equal where MAX's top two
    are clearly apart."""
    difference = np.abs(ours.first_logits - theirs.first_logits).max()
    print(f"largest next-token logit difference from MAX's own pipeline: {difference:.3f} (bound {atol})")
    assert difference <= atol
    assert np.abs(theirs.first_logits).max() > 10 * atol
    top_two = np.sort(theirs.first_logits, axis=1)[:, -2:]
    clear = top_two[:, 1] - top_two[:, 0] > 2 * atol
    first = len(theirs.first_logits)  # the first batch's rows, whose logits these are
    np.testing.assert_array_equal(_tokens(ours)[:first, 0][clear], _tokens(theirs)[:first, 0][clear])


def test_mokv_pipeline_on_gpu_predicts_as_maxs_own(maxs_run: GreedyRun) -> None:
    ours = _run(architecture.mokv_llama_arch)
    assert ours.manager is SchedulerKVCacheManager and maxs_run.manager is not SchedulerKVCacheManager
    _agree(ours, maxs_run, BF16_LOGIT_ATOL)
    equal = _tokens(ours) == _tokens(maxs_run)
    print(f"greedy tokens equal to MAX's: {equal.sum()} of {equal.size}")
    assert ours.metrics.cache_tokens >= 128  # the repeated prompt's first page came from the prefix cache


def test_float8_cache_on_gpu_predicts_as_maxs_bfloat16_within_its_rounding(maxs_run: GreedyRun) -> None:
    """mokv's 8-bit tensor-core kernels under MAX's pipeline (`--kv-cache-format
    float8_e4m3fn`, bfloat16 queries)."""
    ours = _run(architecture.mokv_llama_arch, kv_cache_format="float8_e4m3fn")
    assert ours.manager is SchedulerKVCacheManager
    _agree(ours, maxs_run, FLOAT8_LOGIT_ATOL)
