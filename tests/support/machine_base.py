"""What both managers' hypothesis state machines share: counting generated cases
and operations (`tests.support.property_stats`), and the model's update rule."""

from __future__ import annotations

from typing import Any, ClassVar

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, precondition, rule

from tests.support import property_stats


class ManagerMachine(RuleBasedStateMachine):
    """`live` maps request ids to records with a context (`ctx`) and a `ran`
    flag: the model wrote the context's window since its last update."""

    NAME: ClassVar[str]

    def __init__(self) -> None:
        super().__init__()
        property_stats.CASES[self.NAME] += 1
        self.live: dict[str, Any] = {}
        self.next_id = 0

    def _op(self) -> None:
        property_stats.OPERATIONS[self.NAME] += 1

    @precondition(lambda self: any(r.ran for r in self.live.values()))
    @rule(token=st.integers(0, 3))
    def update(self, token: int) -> None:
        """Every request that ran gets its next token."""
        self._op()
        for r in self.live.values():
            if r.ran:
                r.ctx.update(token)
                r.ran = False
