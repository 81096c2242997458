"""How `mokv generate` shows answers while they grow: a live panel on a terminal,
finished answers on a pipe, tokens as they come for a single prompt."""

from __future__ import annotations

import io

import numpy as np

from mokv_examples.scheduler import Request
from mokv_examples.streaming import FinishedAnswers, LivePanel, TokenStream, answer_display

WORDS = ["alpha", "beta", "gamma", "delta", "epsilon"]


def decode(ids: list[int]) -> str:
    return " ".join(WORDS[i] for i in ids)


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def _feed(display, requests: list[Request], order: list[tuple[int, int]], max_tokens: int) -> None:
    for index, token in order:
        request = requests[index]
        request.generated.append(token)
        request.finished = len(request.generated) == max_tokens
        display(request, token)


def test_the_display_suits_the_output():
    assert isinstance(answer_display(["a"], ["r0"], decode, io.StringIO()), TokenStream)
    assert isinstance(answer_display(["a", "b"], ["r0", "r1"], decode, Terminal()), LivePanel)
    assert isinstance(answer_display(["a", "b"], ["r0", "r1"], decode, io.StringIO()), FinishedAnswers)


def test_live_panel_redraws_every_answer_in_place():
    out = Terminal()
    requests = [Request(f"r{i}", np.array([1]), 2) for i in range(2)]
    panel = LivePanel(["first?", "second?"], ["r0", "r1"], decode, out)
    _feed(panel, requests, [(0, 0), (1, 1), (0, 2), (1, 3)], 2)
    frames = out.getvalue().split("\x1b[J")
    assert len(frames) == 5  # one clear per token
    last = frames[-1]
    assert last == ">>> [1] first?\n    alpha gamma\n>>> [2] second?\n    beta delta\n"
    # Each redraw first moves up over the 4 lines drawn before it.
    assert frames[-2].endswith("\x1b[4F")


def test_finished_answers_come_out_whole_in_finishing_order():
    out = io.StringIO()
    requests = [Request(f"r{i}", np.array([1]), 2 + i) for i in range(2)]
    display = FinishedAnswers(["first?", "second?"], ["r0", "r1"], decode, out)
    for index, token in [(0, 0), (1, 1), (0, 2), (1, 3), (1, 4)]:
        request = requests[index]
        request.generated.append(token)
        request.finished = len(request.generated) == request.max_new_tokens
        display(request, token)
    assert out.getvalue() == "\n>>> first?\nalpha gamma\n\n>>> second?\nbeta delta epsilon\n"


def test_token_stream_writes_only_what_is_new():
    out = io.StringIO()
    request = Request("r0", np.array([1]), 3)
    _feed(TokenStream(decode, out), [request], [(0, 0), (0, 1), (0, 2)], 3)
    assert out.getvalue() == "alpha beta gamma"
