"""The GPU attention planner (`mojo/mokv_kernels/gpu/attention/plan.mojo`)
run on the host as the op runs it (`tests/gpu/attention_plan.mojo`), and a
simulation of the grid it models, for tests to hold its plans to: every
block of a split context takes as long as its tiles plus a fixed overhead,
`resident` blocks run at once and a free slot takes the next block."""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass
from pathlib import Path

from tests.support.mojo_programs import run_program

PROGRAM = Path(__file__).parents[1] / "gpu" / "attention_plan.mojo"
MIN_SPLIT_TOKENS = 256  # config.mojo
MAX_SPLITS = 128
BLOCK_OVERHEAD_TILES = 2  # plan.mojo
MAX_GRID_YZ = 65535  # block.mojo
DECODE_ROWS = 8
H200_MULTIPROCESSORS = 132


@dataclass(frozen=True)
class Case:
    batch: int
    kv_heads: int
    group: int
    max_new: int
    max_context: int
    multiprocessors: int = H200_MULTIPROCESSORS
    decode_blocks: int = 3
    prefill_blocks: int = 2
    tile: int = 64
    prefill_rows: int = 64
    fixed_splits: int = 0
    decode_heads: int = 1
    """KV heads a decode block takes (`MOKV_DECODE_KERNEL=warp_heads`: 4, `=warp_heads_8`: 8)."""
    decode_tile: int = 0
    """Context positions a decode tile spans; 0: `tile`."""

    def numbers(self) -> list[int]:
        return [
            self.batch,
            self.kv_heads,
            self.group,
            self.prefill_rows,
            self.max_new,
            self.max_context,
            self.multiprocessors,
            self.decode_blocks,
            self.decode_tile or self.tile,
            self.prefill_blocks,
            self.tile,
            self.fixed_splits,
            self.decode_heads,
        ]


@dataclass(frozen=True)
class Plan:
    decode: bool
    tokens_per_tile: int
    query_tiles: int
    splits: int


def plans(cases: list[Case]) -> list[Plan]:
    """The planner's plan for each case, from one run of the program."""
    output = run_program(PROGRAM, *(n for case in cases for n in case.numbers()))
    lines = [line.split() for line in output.splitlines() if line.strip()]
    return [Plan(bool(int(d)), int(t), int(q), int(s)) for d, t, q, s in lines]


def simulated_finish(blocks: int, tiles: int, resident: int) -> int:
    """When the last of `blocks` blocks of `tiles` tiles each finishes, with
    `resident` slots each taking the next block as soon as it is free."""
    slots = [0] * min(resident, blocks)
    heapq.heapify(slots)
    for _ in range(blocks):
        heapq.heappush(slots, heapq.heappop(slots) + tiles)
    return max(slots)


def best_splits(case: Case, blocks: int, decode: bool) -> int:
    """The fewest splits whose simulated grid finishes first."""
    resident = (case.decode_blocks if decode else case.prefill_blocks) * case.multiprocessors
    tiles = math.ceil(case.max_context / ((case.decode_tile or case.tile) if decode else case.tile))
    most = min(max(1, case.max_context // MIN_SPLIT_TOKENS), MAX_SPLITS)
    finish = {
        s: simulated_finish(blocks * s, math.ceil(tiles / s) + BLOCK_OVERHEAD_TILES, resident)
        for s in range(1, most + 1)
    }
    return min(finish, key=lambda s: (finish[s], s))


def modelled_plan(case: Case) -> Plan:
    """The plan the grid model expects for `case`: the tile shape its batch
    needs, and the fewest splits whose simulated grid finishes first."""
    decode = case.max_new * case.group <= DECODE_ROWS
    tokens_per_tile = (DECODE_ROWS if decode else case.prefill_rows) // case.group
    query_tiles = math.ceil(case.max_new / tokens_per_tile)
    heads = math.ceil(case.kv_heads / case.decode_heads) if decode else case.kv_heads
    splits = best_splits(case, query_tiles * heads * case.batch, decode)
    return Plan(decode, tokens_per_tile, query_tiles, splits)
