"""The GPU attention planner (`mojo/mokv_kernels/gpu/attention/plan.mojo`),
run on the host as the op runs it (`attention_plan.mojo`), against a
simulation of the grid it models (`tests.support.attention_plan`): every block of a split context takes as
long as its tiles plus a fixed overhead, `resident` blocks run at once and a
free slot takes the next block. The planner must pick the split count whose grid finishes
first, the fewest splits among equals, and the tile shape the batch needs."""

from __future__ import annotations

import pytest

from tests.support.attention_plan import MAX_GRID_YZ, Case, modelled_plan, plans

CASES = [
    # The benchmark's decode cases (Llama's 32/8 heads): batch 1 at 32k, 32 at 4k, 128 at 1k.
    Case(1, 8, 4, 1, 32769),
    Case(32, 8, 4, 1, 4097),
    Case(128, 8, 4, 1, 1025),
    # Its prefill cases, and a batch too short to split.
    Case(1, 8, 4, 2048, 2048),
    Case(1, 8, 4, 512, 8704),
    Case(4, 2, 3, 1, 300),
    # Other devices and kernels: one multiprocessor, few resident blocks, a GQA group of 8.
    Case(3, 4, 8, 1, 20000, multiprocessors=1),
    Case(2, 8, 1, 40, 5000, multiprocessors=16, prefill_blocks=1, tile=32),
    Case(64, 1, 2, 3, 70000, multiprocessors=108, decode_blocks=2),
    # Decode blocks of four KV heads, one a warp, over 16 positions a tile (`warp_heads`).
    Case(1, 8, 4, 1, 32769, decode_heads=4, decode_tile=16),
    Case(32, 8, 4, 1, 4097, decode_heads=4, decode_tile=16),
    Case(128, 8, 4, 1, 1025, decode_heads=4, decode_tile=16),
    # Decode blocks of eight, alone on their multiprocessor (`warp_heads_8`).
    Case(1, 8, 4, 1, 32769, decode_blocks=1, decode_heads=8, decode_tile=16),
    Case(32, 8, 4, 1, 4097, decode_blocks=1, decode_heads=8, decode_tile=16),
]


def test_plans_cut_each_context_into_the_splits_that_finish_first():
    for case, plan in zip(CASES, plans(CASES), strict=True):
        assert plan == modelled_plan(case), case


def test_benchmark_cases_take_the_splits_that_measured_fastest():
    """On an H200 (132 multiprocessors, three decode blocks each), the split
    counts the eighth run's split table (2026-11-28) measured fastest: batch
    32 at 4k three splits (768 blocks in two full waves of 22 tiles, where
    two splits left 116 blocks of 33 tiles in a second wave), batch 1 at 32k
    one wave of 47, batch 128 at 1k none (its 1024 blocks already fill the
    device; four splits ran 10% slower); and 512 new tokens over 8.7k none
    (34 splits of four tiles took twice the time of the seventh run's two)."""
    batch_1, batch_32, batch_128, _, chunk = plans(CASES[:5])
    assert (batch_1.splits, batch_32.splits, batch_128.splits, chunk.splits) == (47, 3, 1, 1)


def test_blocks_of_several_kv_heads_still_fill_the_device_at_batch_1():
    """Batch 1 at 32k: blocks of four KV heads (two blocks a split) and of
    eight (one, alone on its multiprocessor) take 121 splits, 242 and 121
    blocks on an H200's 132 multiprocessors, where a cap of 64 splits left
    the eight-head decode half the device (`MAX_SPLITS`)."""
    four, eight = plans([CASES[9], CASES[12]])
    assert (four.splits, eight.splits) == (121, 121)


@pytest.mark.parametrize(("fixed", "expected"), [(1, 1), (5, 5), (200, 128), (30, 19)])
def test_fixed_splits_are_taken_within_the_bounds(fixed, expected):
    """`MOKV_ATTENTION_SPLITS`: any positive count, at most one split per 256
    context tokens and `MAX_SPLITS` in all."""
    context = 4999 if fixed == 30 else 40000
    (plan,) = plans([Case(32, 8, 4, 1, context, fixed_splits=fixed)])
    assert plan.splits == expected


@pytest.mark.parametrize(("new_tokens", "expected"), [(320000, 3), (640000, 1)])
def test_splits_keep_the_grid_within_its_blocks_along_y(new_tokens, expected):
    """A grid's y counts query tiles times splits (`work.attention_grid`):
    20000 tiles of 16 tokens leave room for three splits, 40000 for one,
    however many are asked for."""
    (plan,) = plans([Case(1, 8, 4, new_tokens, new_tokens, fixed_splits=8)])
    assert plan.query_tiles == new_tokens // 16
    assert plan.splits == expected
    assert plan.query_tiles * plan.splits <= MAX_GRID_YZ
