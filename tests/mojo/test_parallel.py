"""`parallel.run_items`, the fork-join every CPU kernel runs its items through:
each item runs exactly once, helpers join in when there are workers for them,
and a job whose items call `run_items` again finishes (no worker waits forever
for a helper that cannot start)."""

from __future__ import annotations

from pathlib import Path

from tests.support.mojo_programs import run_program

PROGRAM = Path(__file__).with_name("programs") / "parallel_items.mojo"


def test_every_item_runs_exactly_once_on_the_caller_and_its_helpers():
    output = run_program(PROGRAM)
    lines = [line for line in output.splitlines() if line.strip()]
    assert [line.rsplit(" ", 1)[0] for line in lines if line.endswith(" ok")] == [
        "no items",
        "one item",
        "two items",
        "many short items",
        "many long items",
        "nested",
    ], output
