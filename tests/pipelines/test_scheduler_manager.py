"""`SchedulerKVCacheManager` (mokv's manager behind MAX's scheduler interface)
against MAX 26.7's own `PagedKVCacheManager`, in lockstep
(`scheduler_lockstep`), on the request sequences MAX's scheduler produces:
admission (claim + alloc), chunked prefill, decode steps (runtime inputs,
update, step), multi-turn conversations that hit the prefix cache, memory
pressure that preempts (release + reset, readmitted later), cache salts,
replicas and 8-bit KV. Then what has no MAX counterpart on CPU (the tiers)
and the errors.
"""

from __future__ import annotations

import dataclasses
import math
import os
import subprocess
import sys

import numpy as np
import pytest

pytest.importorskip("max.pipelines.kv_cache")

from max.dtype import DType
from max.graph import DeviceRef
from max.nn.kv_cache import BatchCharacteristics as MaxBatchCharacteristics
from max.nn.kv_cache import KVCacheQuantizationConfig, MHAKVCacheParams, MultiKVCacheParams
from max.pipelines.context import TextContext
from max.pipelines.kv_cache import InsufficientBlocksError

from mokv import from_max
from mokv.pipelines.cache_config import MokvCacheConfig
from mokv.pipelines.scheduler_manager import SchedulerKVCacheManager, create_kv_manager
from mokv.tiers import KVConnectorConfig
from tests.support.manager_state import paged_snapshot
from tests.support.scheduler_lockstep import Lockstep, max_context

SYSTEM = np.arange(1000, 1021)  # a 21-token system prompt every conversation starts with


def params(
    page_size: int = 4,
    *,
    replicas: int = 1,
    dtype: DType = DType.float32,
    head_dim: int = 8,
    quant: KVCacheQuantizationConfig | None = None,
) -> MHAKVCacheParams:
    return MHAKVCacheParams(
        dtype=dtype,
        n_kv_heads=1,
        head_dim=head_dim,
        num_layers=1,
        page_size=page_size,
        devices=[DeviceRef.CPU()] * replicas,
        data_parallel_degree=replicas,
        enable_prefix_caching=True,
        enable_dp_cross_replica_prefix_copy=False,  # mokv's replicas never copy pages between them
        kvcache_quant_config=quant,
    )


def token_of(rid: str) -> int:
    """The 'sampled' token of a step: any deterministic function of the request will do."""
    return 7 + sum(map(ord, rid)) % 50


def chat(
    step: Lockstep, rng: np.random.Generator, name: str, turns: int, replica: int = 0, salt: str | None = None
) -> None:
    """A conversation alone on its replica: each turn resends every earlier
    turn (system prompt, user and assistant tokens) plus a new user message,
    decodes a few tokens and finishes, as a chat client does."""
    history = SYSTEM
    for turn in range(turns):
        rid = f"{name}-{turn}"
        history = np.concatenate([history, rng.integers(1, 900, size=int(rng.integers(3, 9)))])
        assert step.admit(rid, history, replica, salt)
        for _ in range(int(rng.integers(1, 6))):
            step.run([rid], token_of)
            assert step.alloc(rid)
        history = step.live[rid].theirs.tokens.all.copy()
        step.release(rid)


def test_multi_turn_chats_hit_the_prefix_cache_alike() -> None:
    step = Lockstep(params(), total_num_pages=64, max_batch_size=8)
    rng = np.random.default_rng(0)
    for name in ("alice", "bob", "carol"):
        chat(step, rng, name, turns=4)
    assert step.hits >= 9  # every later turn, and the system prompt for later chats
    assert step.theirs.get_metrics_aggregated().cache_tokens > 200


def test_concurrent_requests_with_chunked_prefill() -> None:
    """Two waves of requests sharing a system prompt, prompts cut into
    12-token chunks; the second wave is admitted once the first committed
    the shared pages, so its requests share them in one batch."""
    step = Lockstep(params(), total_num_pages=96, max_batch_size=8)
    rng = np.random.default_rng(1)
    prompts = {f"r{i}": np.concatenate([SYSTEM, rng.integers(1, 900, size=int(rng.integers(5, 40)))]) for i in range(6)}
    waves = [list(prompts)[:3], list(prompts)[3:]]
    while waves or step.live:
        if waves and not any(step.live[rid].ours.tokens.actively_chunked for rid in step.live):
            for rid in waves.pop(0):
                assert step.admit(rid, prompts[rid])
        for rid in step.live:
            if step.live[rid].ours.tokens.active_length > 12:
                step.chunk(rid, 12)  # the token budget cuts the prompt; the rest runs next steps
        batch = sorted(step.live)
        step.run(batch, token_of)
        for rid in batch:
            if len(step.live[rid].ours.tokens) - len(prompts[rid]) >= 3:
                step.release(rid)
            else:
                assert step.alloc(rid)
    assert step.steps > 6 and step.hits >= 3


def test_memory_pressure_preempts_alike() -> None:
    """Too few pages for every request: allocations fail on both sides at the
    same step; the scheduler preempts the newest running request (release +
    reset) and readmits it later, when its own committed prefix is a hit."""
    step = Lockstep(params(), total_num_pages=20, max_batch_size=8)
    rng = np.random.default_rng(2)
    waiting = [(f"p{i}", rng.integers(1, 900, size=int(rng.integers(8, 20)))) for i in range(8)]
    running: list[str] = []
    generated: dict[str, int] = {}
    preemptions = 0
    while waiting or running:
        if waiting and step.admit(*waiting[0]):
            running.append(waiting.pop(0)[0])
        for rid in list(running):
            if rid in running and not step.alloc(rid):
                preemptions += 1
                running.remove(rid)
                waiting.insert(0, (rid, step.live.pop(rid).theirs.tokens.all.copy()))
        if running:
            step.run(running, token_of)
        for rid in list(running):
            generated[rid] = generated.get(rid, 0) + 1
            if generated[rid] >= 12:
                running.remove(rid)
                step.release(rid)
    assert preemptions > 0


def test_cache_salts_share_pages_only_within_a_salt() -> None:
    step = Lockstep(params(), total_num_pages=64, max_batch_size=8)
    rng = np.random.default_rng(3)
    chat(step, rng, "tenant-a", turns=2, salt="a")
    hits_before = step.hits
    chat(step, np.random.default_rng(3), "tenant-b", turns=1, salt="b")  # same tokens, other salt
    assert step.hits == hits_before  # nothing of tenant a's served to tenant b
    chat(step, np.random.default_rng(3), "tenant-a-again", turns=1, salt="a")
    assert step.hits > hits_before


def test_replicas_keep_their_own_prefix_caches() -> None:
    step = Lockstep(params(replicas=2), total_num_pages=32, max_batch_size=4)
    chat(step, np.random.default_rng(4), "left", turns=2, replica=0)
    hits = step.hits
    assert step.admit("right", np.concatenate([SYSTEM, [5, 6, 7]]), replica=1)
    assert step.live["right"].ours.cached_prefix_length == 0  # replica 0's pages are not replica 1's
    step.run(["right"], token_of)
    step.release("right")
    assert step.admit("right-again", np.concatenate([SYSTEM, [8, 9]]), replica=1)
    assert step.live["right-again"].ours.cached_prefix_length == 20 and step.hits > hits


def test_8bit_kv_inputs_carry_the_scales_alike() -> None:
    quant = KVCacheQuantizationConfig(scale_dtype=DType.float32, quantization_granularity=16)
    step = Lockstep(params(dtype=DType.float8_e4m3fn, head_dim=16, quant=quant), total_num_pages=32, max_batch_size=4)
    chat(step, np.random.default_rng(5), "q", turns=2)
    assert step.steps >= 2


def test_metric_windows_match_max_and_add_up() -> None:
    step = Lockstep(params(), total_num_pages=64, max_batch_size=8)
    rng = np.random.default_rng(6)
    totals = [0, 0]
    for name in ("x", "y"):
        chat(step, rng, name, turns=2)
        theirs, ours = step.take_metrics()
        assert (theirs.cache_tokens, theirs.input_tokens) == (ours.cache_tokens, ours.input_tokens)
        assert ours.device_blocks_served == ours.cache_tokens // 4
        totals = [totals[0] + ours.cache_tokens, totals[1] + ours.input_tokens]
    assert step.ours.get_metrics_aggregated().cache_tokens == 0  # nothing since the last take
    everything = step.ours.manager.get_metrics_aggregated()  # mokv's own counters never cleared
    assert [everything.cache_tokens, everything.input_tokens] == totals and totals[0] > 0


# --------------------------------------------------------------------- tiers


def _served(manager: SchedulerKVCacheManager, rid: str, tokens: np.ndarray, *, keep: bool = False) -> TextContext:
    """A request admitted, run one step (its full pages committed) and, unless
    `keep`, released: what a finished turn leaves in the cache."""
    ctx = max_context(rid, tokens)
    manager.claim(ctx)
    manager.alloc(ctx)
    manager.runtime_inputs([[ctx]])
    ctx.update(token_of(rid))
    manager.step(ctx)
    if not keep:
        manager.release(ctx)
    return ctx


def test_host_tier_hits_are_reported_as_external() -> None:
    ours = SchedulerKVCacheManager.create(
        params(), None, 8, max_batch_size=4, total_num_host_pages=16, enable_runtime_checks=True
    )
    first = np.arange(100, 121)
    _served(ours, "first", first)
    _served(ours, "filler", np.arange(500, 531))  # 8 pages: evicts first's cached pages to the host tier
    ours.take_metrics_aggregated()
    assert ours.host_byte_count().used > 0
    again = _served(ours, "again", first, keep=True)
    assert again.cached_prefix_length == 20 and again.cached_prefix_external_length == 20
    window = ours.take_metrics_aggregated()
    assert window.cache_tokens == 20 and window.device_blocks_served == 0 and window.h2d_bytes_copied > 0
    ours.release(again)


def test_a_disk_tier_serves_a_second_manager(tmp_path) -> None:
    """Two managers (two servers) on one disk directory: the second serves a
    prompt only the first computed, as an external hit."""
    config = KVConnectorConfig(model_id="lockstep", disk_offload_dir=tmp_path, integrity_key=b"k" * 32)
    prompt = np.arange(300, 341)
    with SchedulerKVCacheManager.create(params(), None, 32, max_batch_size=4, connector_config=config).manager as m:
        first = SchedulerKVCacheManager(params(), m)
        _served(first, "one", prompt)
        first.manager.flush()
    second = SchedulerKVCacheManager.create(params(), None, 32, max_batch_size=4, connector_config=config)
    ctx = _served(second, "two", prompt, keep=True)
    assert ctx.cached_prefix_length == 40 and ctx.cached_prefix_external_length == 40
    assert second.take_metrics_aggregated().disk_bytes_read > 0 and second.disk_byte_count().used > 0
    second.release(ctx)
    second.shutdown()


# -------------------------------------------------------------------- errors


def _refused(manager: SchedulerKVCacheManager, call, error: type[Exception], names: str) -> None:
    """`call` raises `error` naming `names`, and the manager is exactly as before."""
    before = paged_snapshot(manager.manager)
    with pytest.raises(error, match=names):
        call()
    assert paged_snapshot(manager.manager) == before


def test_bad_calls_name_the_value_and_change_nothing() -> None:
    ours = SchedulerKVCacheManager.create(params(), None, 8, max_batch_size=2, enable_runtime_checks=True)
    a, ghost = max_context("a", np.arange(10)), max_context("ghost", np.arange(5))
    ours.claim(a)
    _refused(ours, lambda: ours.runtime_inputs([[a]]), ValueError, "call alloc first")
    ours.alloc(a)
    _refused(ours, lambda: ours.claim(a), ValueError, r"value='a'\) is already claimed on replica 0")
    _refused(ours, lambda: ours.claim(ghost, replica_idx=2), ValueError, "replica_idx=2")
    _refused(ours, lambda: ours.alloc(ghost), ValueError, r"value='ghost'\) is not claimed")
    _refused(ours, lambda: ours.release(ghost), ValueError, r"value='ghost'\) is not claimed")
    _refused(ours, lambda: ours.step(ghost), ValueError, r"value='ghost'\) is not claimed")
    _refused(ours, lambda: ours.runtime_inputs([[a], []]), ValueError, "one batch per replica")
    big = max_context("big", np.arange(100, 130))  # 8 pages; 5 are free
    ours.claim(big)
    _refused(ours, lambda: ours.alloc(big), InsufficientBlocksError, r"value='big'\) needs 8 new pages")
    assert (big.tokens.processed_length, big.tokens.active_length, big.cached_prefix_length) == (0, 30, None)


def test_construction_refuses_what_mokv_cannot_serve() -> None:
    with pytest.raises(ValueError, match="kv_hash_algo"):
        SchedulerKVCacheManager.create(dataclasses.replace(params(), kv_hash_algo="sha256"), None, 8, max_batch_size=2)
    tree = MultiKVCacheParams.from_params({"a": params(), "b": params()})
    with pytest.raises(TypeError, match="MHAKVCacheParams"):
        SchedulerKVCacheManager.create(tree, None, 8, max_batch_size=2)
    other = SchedulerKVCacheManager.create(params(page_size=8), None, 8, max_batch_size=2).manager
    with pytest.raises(ValueError, match="page_size=8"):
        SchedulerKVCacheManager(params(), other)


# ------------------------------------------------------------------ the seam


def _cache(tiered: bool = False) -> MokvCacheConfig:
    return MokvCacheConfig(from_max(params()), host_offload_max_gb=None, tiered=tiered)


@pytest.mark.parametrize(
    ("budget_pages", "expected"),
    [(1000, 4 * 8), (20, 19)],  # capped at a full batch (4 requests of 8 pages); else the budget less the null page
)
def test_create_kv_manager_sizes_the_pool_as_max_does(budget_pages: int, expected: int) -> None:
    cache = _cache(tiered=True)
    made = create_kv_manager(
        params(),
        cache,
        max_batch_size=4,
        max_seq_len=30,  # 8 pages of 4 tokens
        session=None,
        available_cache_memory=budget_pages * cache.params.bytes_per_page,
        max_num_input_tokens=None,
    )
    assert made.manager.total_num_pages == expected and made.block_count().total == expected
    assert made.manager.total_num_host_pages == math.ceil(1.5 * expected)  # MAX's host default, 1.5 pools


def test_create_kv_manager_refuses_a_budget_shorter_than_one_request() -> None:
    cache = _cache()
    with pytest.raises(ValueError, match="max_seq_len=30"):
        create_kv_manager(
            params(),
            cache,
            max_batch_size=4,
            max_seq_len=30,
            session=None,
            available_cache_memory=8 * cache.params.bytes_per_page,  # 7 pages beside the null page
            max_num_input_tokens=None,
        )


COMPILE_ONLY_SCRIPT = """
from max import driver
driver.set_virtual_device_api("cuda")
driver.set_virtual_device_target_arch("sm_90a")
driver.set_virtual_device_count(1)
from max.dtype import DType
from max.graph import DeviceRef
from max.nn.kv_cache import MHAKVCacheParams
from mokv import from_max
from mokv.pipelines.cache_config import MokvCacheConfig
from mokv.pipelines.compile_only import CompileOnlyKVCacheManager
from mokv.pipelines.scheduler_manager import create_kv_manager
params = MHAKVCacheParams(dtype=DType.bfloat16, n_kv_heads=8, head_dim=128, num_layers=2, page_size=16,
                          devices=[DeviceRef.GPU()], enable_prefix_caching=True)
cache = MokvCacheConfig(from_max(params), host_offload_max_gb=None, tiered=False)
made = create_kv_manager(params, cache, max_batch_size=4, max_seq_len=100, session=None,
                         available_cache_memory=1 << 40, max_num_input_tokens=None)
assert isinstance(made, CompileOnlyKVCacheManager), type(made)
assert made.total_num_pages == 4 * 7 and made.params == from_max(params), (made.total_num_pages, made.params)
try:
    made.alloc
except AttributeError as error:
    assert "alloc: this pipeline was built in compile-only mode" in str(error), error
else:
    raise AssertionError("a compile-only manager served alloc")
assert not hasattr(made, "runtime_inputs")
print("compile-only manager ok")
"""


def test_compile_only_mode_checks_the_cache_and_allocates_nothing() -> None:
    """`max warm-cache --target` compiles a pipeline for a virtual GPU, where no memory can
    be allocated: the seam sizes the pool as it would, allocates nothing and returns a
    manager that refuses every request call (in a process of its own: virtual device mode
    is entered before any device exists, and for the whole process)."""
    result = subprocess.run(
        [sys.executable, "-c", COMPILE_ONLY_SCRIPT],
        capture_output=True,
        text=True,
        env=dict(os.environ),  # the environment this process started with (see mokv.kernels)
        timeout=300,
        check=False,
    )
    assert result.returncode == 0 and "compile-only manager ok" in result.stdout, result.stderr[-3000:]


def test_dummies_bounds_and_buffers_alike() -> None:
    """A padding request (`alloc_dummy`), a fixed lookup-table width
    (`max_cache_length`) and a captured batch shape (`BatchCharacteristics`)
    give the same inputs on both sides; the device buffer is the pages the
    inputs carry."""
    step = Lockstep(params(), total_num_pages=16, max_batch_size=4)
    assert step.admit("real", np.arange(1, 11))
    pad = [max_context("pad", np.zeros(1, np.int64)) for _ in "ab"]
    for manager, ctx in zip(step.managers, pad, strict=True):
        manager.alloc_dummy(ctx, replica_idx=0)
        assert manager.num_req_blocks(ctx) == 1 and manager.get_req_blocks_per_leaf(ctx) == {"full_group": [16]}
    real = step.live["real"]
    bounds = MaxBatchCharacteristics(batch_size=4, max_prompt_length=16, max_cache_valid_length=40)
    for kwargs in ({}, {"max_cache_length": 40}, {"batch_characteristics": bounds}):
        theirs = step.theirs.runtime_inputs([[real.theirs, pad[0]]], **kwargs)
        ours = step.ours.runtime_inputs([[real.ours, pad[1]]], **kwargs)
        step.compare_inputs(theirs, ours, [[real.theirs, pad[0]]])
        if "max_cache_length" in kwargs:
            assert ours[0].lookup_table.shape == (2, 10)  # ceil(40 / 4) pages
    buffer = step.ours.get_device_buffer(0)
    assert buffer.all_buffers == [ours[0].kv_blocks]
    assert step.ours.pressure_pct(0) == pytest.approx(100 * 3 / 16)
