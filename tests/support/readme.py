"""The README's "Using it in a graph" example, as the README test and the packaging
test (which runs it on an installed wheel) read it."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parents[2] / "README.md"


def readme_example() -> str:
    """The Python code block of the README's "Using it in a graph" section."""
    section = README.read_text().split("## Using it in a graph", 1)[1]
    match = re.search(r"```python\n(.*?)```", section, re.DOTALL)
    assert match, "the section has no python example"
    return match.group(1)
