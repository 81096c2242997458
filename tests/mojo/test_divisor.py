"""`Divisor` (the page and scale-block sizes every located key divides its
position by) against Python's integer division, over the divisors a cache
can have and the dividends at the edges of its range."""

from __future__ import annotations

import random
from pathlib import Path

from tests.support.mojo_programs import run_program

PROGRAM = Path(__file__).with_name("programs") / "divisor_quotients.mojo"
LARGEST = 2**31 - 1


def _pairs() -> list[tuple[int, int]]:
    rng = random.Random(43)
    divisors = list(range(1, 300)) + [2**k for k in range(31)] + [2**k + 1 for k in range(1, 31)]
    divisors += [2**k - 1 for k in range(2, 32)] + [rng.randrange(1, LARGEST + 1) for _ in range(200)]
    pairs = []
    for d in divisors:
        edges = [0, 1, d - 1, d, d + 1, LARGEST, LARGEST - 1, LARGEST - LARGEST % d, LARGEST // d * d - 1]
        edges += [rng.randrange(0, LARGEST + 1) for _ in range(6)]
        pairs += [(n, d) for n in edges if 0 <= n <= LARGEST]
    return pairs


def test_quotients_and_remainders_equal_integer_division():
    pairs = _pairs()
    output = run_program(PROGRAM, *[v for pair in pairs for v in pair])
    lines = output.split("\n")[: len(pairs)]
    wrong = []
    for (n, d), line in zip(pairs, lines, strict=True):
        if line.split() != [str(n), str(d), str(n // d), str(n % d)]:
            wrong.append(f"{n} // {d}: {line!r}, expected {n // d} remainder {n % d}")
    assert not wrong, f"{len(wrong)} of {len(pairs)} wrong, first: {wrong[:5]}"


def test_divisors_outside_the_range_are_refused():
    output = run_program(PROGRAM, 5, 0, 5, -3, 5, 2**31)
    assert output.split("\n")[:3] == ["refused 0", "refused -3", f"refused {2**31}"], output
