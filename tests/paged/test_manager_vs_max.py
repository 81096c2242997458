"""mokv's manager and MAX 26.7's own `PagedKVCacheManager`, in lockstep.

Both implement the same policy (vLLM v1 style: LRU free queue, tail-first
release, commit on step, dedup), so on the same workload they must hand out the
very same page ids, keep the same number of pages free, fail the same
allocations, count the same tokens and build the same lookup tables.

One deliberate difference is kept out of the comparison: MAX counts a failed
allocation's tokens as computed input (mokv's metrics count only allocations
that happened), so MAX's input tokens are compared net of its failed
allocations. A failed allocation's other effect, refreshing the recency of
the prefix hits it matched, is the same in both, so admissions here may fail.
"""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("max.pipelines.kv_cache")

from max.driver import CPU
from max.dtype import DType
from max.engine import InferenceSession
from max.graph import DeviceRef
from max.nn.kv_cache import KVCacheQuantizationConfig, MHAKVCacheParams
from max.pipelines.kv_cache import PagedKVCacheManager as MaxManager

from mokv import PagedKVCacheManager, TextContext
from mokv_reference.manager_backends import MaxBackend, MokvBackend


class Lockstep:
    """Applies every operation to both managers and compares what they report."""

    def __init__(self, page_size: int, total_num_pages: int, max_batch_size: int) -> None:
        self.ours = MokvBackend(page_size, total_num_pages, max_batch_size)
        self.theirs = MaxBackend(page_size, total_num_pages, max_batch_size)
        self.live: dict[str, tuple[object, object]] = {}
        self.max_failed_input_tokens = 0

    def check(self) -> None:
        assert self.ours.num_free_blocks() == self.theirs.num_free_blocks()
        for rid, (a, b) in self.live.items():
            assert self.ours.blocks(a) == self.theirs.blocks(b), rid
            assert a.processed_length == b.tokens.processed_length, rid

    def admit(self, rid: str, prompt: np.ndarray) -> bool:
        """claim + alloc on both; a request that does not fit is released again."""
        pair = (self.ours.new_context(rid, prompt), self.theirs.new_context(rid, prompt))
        self.ours.claim(pair[0])
        self.theirs.claim(pair[1])
        self.live[rid] = pair
        if self.alloc(rid):
            return True
        self.release(rid)
        return False

    def alloc(self, rid: str) -> bool:
        """alloc on both; both must succeed or both fail."""
        max_input_before = self.theirs.manager.get_metrics_aggregated().input_tokens
        outcomes = []
        for backend, c in zip((self.ours, self.theirs), self.live[rid], strict=True):
            try:
                backend.alloc(c)
                outcomes.append(True)
            except Exception as e:  # MAX raises its own InsufficientBlocksError class
                # lockstep: either outcome is allowed as long as both agree
                assert "block" in str(e).lower() or "pages" in str(e).lower(), e  # noqa: PT017
                outcomes.append(False)
        assert outcomes[0] == outcomes[1], f"{rid}: mokv ok={outcomes[0]}, MAX ok={outcomes[1]}"
        if not outcomes[0]:
            max_input = self.theirs.manager.get_metrics_aggregated().input_tokens
            self.max_failed_input_tokens += max_input - max_input_before
        self.check()
        return outcomes[0]

    def decode(self, token_of: dict[str, int]) -> None:
        """One model step for every live request: runtime inputs, update, step."""
        ours = [a for a, _ in self.live.values()]
        theirs = [b for _, b in self.live.values()]
        (mine,) = self.ours.runtime_inputs(ours).inputs
        (ref,) = self.theirs.runtime_inputs(theirs)
        compare_inputs(mine, ref, self.ours.manager.total_num_pages)
        for rid, (a, b) in self.live.items():
            a.update(token_of[rid])
            b.update(token_of[rid])
        self.ours.step(ours)
        self.theirs.step(theirs)
        self.check()

    def release(self, rid: str) -> None:
        a, b = self.live.pop(rid)
        self.ours.release(a)
        self.theirs.release(b)
        self.check()


def compare_inputs(mine, ref, null_page: int) -> None:
    """MAX pads its lookup table to a SIMD-friendly width; the rest must match."""
    table = mine.lookup_table.to_numpy()
    ref_table = ref.lookup_table.to_numpy()
    width = table.shape[1]
    np.testing.assert_array_equal(table, ref_table[:, :width])
    assert (ref_table[:, width:] == null_page).all()
    np.testing.assert_array_equal(mine.cache_lengths.to_numpy(), ref.cache_lengths.to_numpy())
    max_new, max_context = mine.max_lengths.to_numpy()[0]
    assert max_new == ref.max_prompt_length.to_numpy()[0]
    assert max_context == ref.max_cache_length.to_numpy()[0]


@pytest.mark.parametrize(
    ("page_size", "total_num_pages", "prompt_scale"),
    [(1, 150, 1), (3, 50, 1), (16, 20, 4), (128, 10, 24)],
)
def test_random_workload_matches_max(page_size: int, total_num_pages: int, prompt_scale: int) -> None:
    rng = np.random.default_rng(page_size)
    run = Lockstep(page_size, total_num_pages, max_batch_size=8)
    prefixes = [rng.integers(0, 4, size=prompt_scale * rng.integers(4, 40)) for _ in range(3)]
    failures = 0
    for i in range(120):
        suffix = rng.integers(0, 4, size=prompt_scale * rng.integers(1, 8))
        prompt = np.concatenate([prefixes[rng.integers(3)], suffix])
        roll = rng.random()
        if run.live and (roll < 0.15 or len(run.live) >= 8):
            run.release(list(run.live)[rng.integers(len(run.live))])
        elif run.live and roll < 0.6:
            run.decode({rid: int(rng.integers(0, 4)) for rid in run.live})
            for rid in list(run.live):
                if not run.alloc(rid):
                    run.release(rid)
                    failures += 1
        elif not run.admit(f"r{i}", prompt):
            failures += 1
    for rid in list(run.live):
        run.release(rid)
    ours = run.ours.manager.get_metrics_aggregated()
    theirs = run.theirs.manager.get_metrics_aggregated()
    assert ours.cache_tokens == theirs.cache_tokens > 0
    assert ours.input_tokens == theirs.input_tokens - run.max_failed_input_tokens
    assert failures > 0  # the workload ran out of pages


def test_a_failed_admission_refreshes_its_prefix_as_max_does() -> None:
    """The issue's reproduction: after C's failed admission, MAX has moved C's
    prefix hits to the recent end of the free queue, so D's allocation evicts
    other pages and C's retry reuses all 4 prefix tokens (not 2)."""
    run = Lockstep(page_size=1, total_num_pages=10, max_batch_size=8)
    assert run.admit("G", np.array([30, 31]))
    assert run.admit("A", np.array([1, 2, 3, 4]))
    run.decode({"G": 0, "A": 5})
    run.release("A")
    run.release("G")
    assert run.admit("H", np.array([20, 21, 22, 23]))
    pair = (
        run.ours.new_context("C", np.array([1, 2, 3, 4, 40, 41, 42])),
        run.theirs.new_context("C", np.array([1, 2, 3, 4, 40, 41, 42])),
    )
    run.ours.claim(pair[0])
    run.theirs.claim(pair[1])
    run.live["C"] = pair
    assert not run.alloc("C")
    assert run.admit("D", np.array([60, 61]))
    run.release("H")
    assert run.alloc("C")
    ours, theirs = run.live["C"]
    assert ours.processed_length == theirs.tokens.processed_length == 4


@pytest.mark.parametrize("granularity", [16, 8])
def test_a_quantized_cache_allocates_the_memory_max_allocates(granularity: int) -> None:
    """The same MAX params given to both managers (mokv converts them): equal
    page and scales tensors (shape, dtype; the null page included) and equal
    bytes per page (MAX's bytes_per_block), and the runtime inputs hand the graph those scales."""
    params = MHAKVCacheParams(
        dtype=DType.float8_e4m3fn,
        n_kv_heads=2,
        head_dim=16,
        num_layers=3,
        page_size=8,
        devices=[DeviceRef.CPU()],
        enable_prefix_caching=True,
        kvcache_quant_config=KVCacheQuantizationConfig(quantization_granularity=granularity),
    )
    theirs = MaxManager(
        params=params, session=InferenceSession(devices=[CPU()]), total_num_pages=5, max_batch_size=2
    ).get_device_buffer(0)
    ours_manager = PagedKVCacheManager(params, None, 5, max_batch_size=2)
    ours = ours_manager.get_device_buffer(0)
    assert theirs.scales is not None and ours.scales is not None
    for mine, max_own in ((ours.values, theirs.values), (ours.scales, theirs.scales)):
        assert [(tuple(b.shape), b.dtype) for b in mine] == [(tuple(b.shape), b.dtype) for b in max_own]
    assert ours_manager.params.bytes_per_page == params.bytes_per_block

    c = TextContext("a", np.arange(10))
    ours_manager.claim("a")
    ours_manager.alloc(c)
    (device,) = ours_manager.runtime_inputs([[c]]).inputs
    assert device.scales is ours.scales[0]
