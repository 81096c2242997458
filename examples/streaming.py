"""How `mokv generate` shows answers while they are generated.

The batch decodes every prompt at once, so every answer grows at once. How that is shown
depends on where it goes:

- one prompt: its tokens are written as they arrive, on any output;
- several prompts on a terminal (`LivePanel`): a few lines per prompt, its answer so far
  wrapped under its prompt, all of them redrawn in place after every token, so the answers
  can be watched growing side by side;
- several prompts on a pipe or in a log (`FinishedAnswers`): a log cannot be redrawn, so
  each answer is written whole as soon as its request finishes.

Each is an `on_token(request, token)` callback for `pipeline.run_prompts`.
"""

from __future__ import annotations

import shutil
import sys
import textwrap
from collections.abc import Callable, Sequence
from typing import TextIO

from mokv_examples.scheduler import Request

Decode = Callable[[list[int]], str]


class TokenStream:
    """Writes one request's text as it grows (decoding the whole answer each time, so
    characters spread over several tokens come out whole)."""

    def __init__(self, decode: Decode, out: TextIO | None = None) -> None:
        self.decode = decode
        self.out = out or sys.stdout
        self.written = 0

    def __call__(self, request: Request, token: int) -> None:
        text = self.decode(request.generated)
        self.out.write(text[self.written :])
        self.out.flush()
        self.written = len(text)


class LivePanel:
    """All answers on a terminal, each under its prompt, redrawn in place as they grow."""

    def __init__(
        self, prompts: Sequence[str], request_ids: Sequence[str], decode: Decode, out: TextIO | None = None
    ) -> None:
        self.prompts = list(prompts)
        self.index = {rid: i for i, rid in enumerate(request_ids)}
        self.decode = decode
        self.out = out or sys.stdout
        self.answers = [""] * len(prompts)
        self.lines_drawn = 0

    def __call__(self, request: Request, token: int) -> None:
        self.answers[self.index[request.request_id]] = self.decode(request.generated)
        self.redraw()

    def lines(self, width: int) -> list[str]:
        """The panel's text, wrapped to `width` columns."""
        lines: list[str] = []
        for i, (prompt, answer) in enumerate(zip(self.prompts, self.answers, strict=True)):
            lines += textwrap.wrap(f">>> [{i + 1}] {prompt}", width) or [""]
            for paragraph in answer.strip().split("\n"):
                lines += textwrap.wrap(paragraph, width, initial_indent="    ", subsequent_indent="    ") or [""]
        return lines

    def redraw(self) -> None:
        width = max(20, shutil.get_terminal_size().columns - 1)
        lines = self.lines(width)
        # Back to the panel's first line, clear to the end of the screen, draw again.
        up = f"\x1b[{self.lines_drawn}F" if self.lines_drawn else ""
        self.out.write(up + "\x1b[J" + "\n".join(lines) + "\n")
        self.out.flush()
        self.lines_drawn = len(lines)


class FinishedAnswers:
    """Each answer written whole, under its prompt, when its request finishes."""

    def __init__(
        self, prompts: Sequence[str], request_ids: Sequence[str], decode: Decode, out: TextIO | None = None
    ) -> None:
        self.prompts = dict(zip(request_ids, prompts, strict=True))
        self.decode = decode
        self.out = out or sys.stdout

    def __call__(self, request: Request, token: int) -> None:
        if request.finished:
            self.out.write(f"\n>>> {self.prompts[request.request_id]}\n{self.decode(request.generated).strip()}\n")
            self.out.flush()


def answer_display(prompts: Sequence[str], request_ids: Sequence[str], decode: Decode, out: TextIO | None = None):
    """The `on_token` display that suits `out` (default stdout) for these prompts."""
    out = out or sys.stdout
    if len(prompts) == 1:
        return TokenStream(decode, out)
    if out.isatty():
        return LivePanel(prompts, request_ids, decode, out)
    return FinishedAnswers(prompts, request_ids, decode, out)
