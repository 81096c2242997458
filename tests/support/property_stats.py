"""How much the property tests ran: generated cases (state machine runs) and
operations (rules applied), per machine, reported at the end of the session."""

from __future__ import annotations

from collections import Counter

CASES: Counter[str] = Counter()
OPERATIONS: Counter[str] = Counter()


def summary() -> list[str]:
    """One line per machine that ran, for the terminal summary."""
    return [f"{name}: {CASES[name]} generated cases, {OPERATIONS[name]} operations" for name in sorted(CASES)]
