"""The README and the docs name only what exists: every command they quote runs (the `mokv`
command's subcommands and options as quoted, `make` targets, pixi tasks, `python -m`
modules), every repository path they name is there, and every relative link leads to a
file and, with an anchor, to one of its headings.

A `mokv` command line is reduced to its subcommand path, each `--option` it quotes is looked
up on that subcommand, and `mokv <path> --help` runs through click's test runner on the
`mokv` command's click group, so no model loads and nothing is compiled.
"""

from __future__ import annotations

import importlib.util
import re
import shlex
import tomllib
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", REPO / "tests" / "gpu" / "README.md", *sorted((REPO / "docs").glob("*.md"))]
"""The pages checked: the README, the GPU protocol and every page of docs/ (the tables
under docs/gpu/results/ are benchmark output, kept as written)."""

REPO_FOLDERS = ("docs", "examples", "graphs", "mojo", "python", "reference", "tests", "tools")
"""A quoted path starting with one of these names a file or folder of the repository."""

SHELLS = ("bash", "sh", "shell", "console")
FENCE = re.compile(r"^```([\w-]*)\n(.*?)^```", re.MULTILINE | re.DOTALL)
INLINE = re.compile(r"`([^`]+)`")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
ENV = re.compile(r"^[A-Z_][A-Z0-9_]*=")


@dataclass(frozen=True)
class Quote:
    """A command line or path quoted in a page, with where it was quoted."""

    text: str
    where: str


def fenced_blocks(text: str) -> list[tuple[str, str]]:
    """(language, body) of every fenced code block."""
    return [(m.group(1), m.group(2)) for m in FENCE.finditer(text)]


def prose(text: str) -> str:
    """The page without its fenced code blocks."""
    return FENCE.sub("", text)


def command_lines(text: str, page: str) -> list[Quote]:
    """Every command of a page's shell blocks (continuations joined, `&&`, `;` and `|`
    splitting commands), and every inline code span of its prose."""
    quotes = []
    for language, body in fenced_blocks(text):
        if language not in SHELLS:
            continue
        lines = body.replace("\\\n", " ").splitlines()
        parts = [part.strip() for line in lines for part in re.split(r"&&|;|\|", line)]
        quotes += [Quote(part, f"{page} (code block)") for part in parts if part]
    quotes += [Quote(" ".join(span.split()), f"{page} (inline)") for span in INLINE.findall(prose(text))]
    return quotes


def words(command: str) -> list[str]:
    """The command's words, comments and leading `NAME=value` assignments dropped."""
    try:
        tokens = shlex.split(command, comments=True)
    except ValueError:  # an unbalanced quote in prose: not a command line
        return []
    while tokens and ENV.match(tokens[0]):
        tokens.pop(0)
    return tokens


@cache
def mokv_cli() -> click.Group:
    """The `mokv` command's click group."""
    from mokv_examples.cli import main

    return main


@cache
def make_targets() -> frozenset[str]:
    return frozenset(re.findall(r"^([\w.-]+):", (REPO / "Makefile").read_text(), re.MULTILINE))


@cache
def pixi_tasks() -> frozenset[str]:
    config = tomllib.loads((REPO / "pixi.toml").read_text())
    tasks = set(config.get("tasks", {}))
    for feature in config.get("feature", {}).values():
        tasks.update(feature.get("tasks", {}))
    return frozenset(tasks)


def option_names(command: click.Command) -> set[str]:
    names = {"--help"}
    for param in command.params:
        if isinstance(param, click.Option):
            names.update(param.opts + param.secondary_opts)
    return names


def check_mokv(args: list[str]) -> str | None:
    """Why `mokv ARGS` does not run as quoted, or None."""
    args = list(args)
    command: click.Command = mokv_cli()
    path: list[str] = []
    while isinstance(command, click.Group) and args and not args[0].startswith("-"):
        sub = command.commands.get(args[0])
        if sub is None:
            if args[0] == "...":
                break  # a placeholder
            return f"`mokv {' '.join([*path, ''])}` has no command {args[0]!r}"
        command = sub
        path.append(args.pop(0))
    known = option_names(command)
    for arg in args:
        name = arg.strip("[]").split("=", 1)[0]
        if name.startswith("--") and name not in known:
            return f"`mokv {' '.join(path)}` has no option {name}"
    result = CliRunner().invoke(mokv_cli(), [*path, "--help"])
    if result.exit_code != 0:
        return f"`mokv {' '.join(path)} --help` exits {result.exit_code}: {result.output}"
    return None


def check_path(word: str) -> str | None:
    """Why a quoted repository path does not exist, or None (also for words that are no path)."""
    word = word.split("::", 1)[0]
    word = re.sub(r":\d+$", "", word)
    if not word.startswith(tuple(f"{folder}/" for folder in REPO_FOLDERS)):
        return None
    if any(mark in word for mark in ("*", "...", "<", "{", "$")) or " " in word:
        return None  # a pattern or a placeholder
    if not (REPO / word).exists():
        return f"no such file or folder: {word}"
    return None


def check_command(quote: str) -> str | None:
    """Why a quoted command does not run as written, or None (also for spans that are
    not commands of this repository)."""
    tokens = words(quote)
    if not tokens:
        return None
    program, args = tokens[0], tokens[1:]
    if program in ("mokv", ".venv/bin/mokv"):
        return check_mokv(args)
    if program == "make":
        unknown = [t for t in args if not t.startswith("-") and "=" not in t and t not in make_targets()]
        return f"the Makefile has no target {unknown[0]!r}" if unknown else None
    if program == "pixi" and args[:1] == ["run"]:
        rest = args[1:]
        if rest[:1] == ["-e"]:
            rest = rest[2:]
        if rest and rest[0] not in pixi_tasks() and rest[0] != "mokv":
            return f"pixi.toml has no task {rest[0]!r}"
        return check_mokv(rest[1:]) if rest[:1] == ["mokv"] else None
    module = args[1] if program.endswith("python") and args[:1] == ["-m"] and len(args) > 1 else ""
    if module.startswith("mokv") and importlib.util.find_spec(module) is None:
        return f"no module {module}"
    for word in tokens:
        problem = check_path(word)
        if problem:
            return problem
    return None


def heading_anchors(text: str) -> set[str]:
    """GitHub's anchors of a page's headings."""
    anchors = set()
    for line in prose(text).splitlines():
        match = re.match(r"#{1,6}\s+(.*)", line)
        if match:
            title = re.sub(r"[^\w\- ]", "", match.group(1).strip().lower())
            anchors.add(title.replace(" ", "-"))
    return anchors


def check_link(page: Path, text: str, target: str) -> str | None:
    """Why a link of `page` (whose text is `text`) leads nowhere, or None (also for links
    off the repository)."""
    if re.match(r"^[a-z]+:", target):
        return None
    file_part, _, anchor = target.partition("#")
    if not file_part:
        linked, linked_text = page, text
    else:
        linked = (page.parent / file_part).resolve()
        if not linked.exists():
            return f"links to {file_part}, which does not exist"
        linked_text = linked.read_text() if linked.suffix == ".md" else ""
    if anchor and linked.suffix == ".md" and anchor not in heading_anchors(linked_text):
        return f"links to #{anchor}, which is no heading of {linked.relative_to(REPO)}"
    return None


def problems_in(page: Path, text: str) -> list[str]:
    """Every quoted command, path or link of `text` (the page `page`) that leads nowhere."""
    name = page.relative_to(REPO).as_posix()
    problems = []
    for quote in command_lines(text, name):
        problem = check_command(quote.text)
        if problem:
            problems.append(f"{quote.where}: `{quote.text}`: {problem}")
    for target in LINK.findall(INLINE.sub("", prose(text))):
        problem = check_link(page, text, target)
        if problem:
            problems.append(f"{name}: link ({target}) {problem}")
    return problems


def page_id(page: Path) -> str:
    return page.relative_to(REPO).as_posix()


@pytest.mark.parametrize("page", DOCS, ids=page_id)
def test_quoted_commands_paths_and_links_exist(page: Path) -> None:
    problems = problems_in(page, page.read_text())
    assert not problems, "\n".join(problems)


DOCS_PYTHON = [
    pytest.param(page, body, id=f"{page_id(page)}-{k}")
    for page in DOCS[2:]
    for k, (language, body) in enumerate(fenced_blocks(page.read_text()))
    if language == "python"
]


@pytest.mark.parametrize(("page", "body"), DOCS_PYTHON)
def test_python_examples_in_the_docs_run_as_written(page: Path, body: str) -> None:
    """The docs' Python blocks run (the README's graph example has its own test)."""
    exec(compile(body, str(page), "exec"), {})


def test_every_docs_page_is_linked_from_the_readme() -> None:
    readme = (REPO / "README.md").read_text()
    linked = {(REPO / target.partition("#")[0]).resolve() for target in LINK.findall(prose(readme))}
    missing = [page_id(page) for page in DOCS[2:] if page.resolve() not in linked]
    assert not missing, f"README.md links to none of {missing}"


def test_the_checks_see_the_commands_the_readme_quotes() -> None:
    readme = (REPO / "README.md").read_text()
    quoted = {" ".join(words(quote.text)[:2]) for quote in command_lines(readme, "README.md")}
    assert {"make demo", "make test", ".venv/bin/mokv generate"} <= quoted


def test_the_checks_catch_what_does_not_exist() -> None:
    page = REPO / "docs" / "example.md"
    bad = "\n".join(
        [
            "# Example",
            "```bash",
            ".venv/bin/mokv generate --no-such-option 3",
            "make no-such-target",
            "```",
            "Run `mokv frobnicate`, `mokv bench nothing --quick`, `pixi run no-such-task` and",
            "`tools/no_such_tool.sh`; see [a page](no-such-page.md) and [a heading](#no-such-heading).",
        ]
    )
    good = '# Example\n```bash\n.venv/bin/mokv generate --kv-dtype int8 "Hi"\nmake test\n```\n[up](#example)\n'
    assert len(problems_in(page, bad)) == 8, problems_in(page, bad)
    assert problems_in(page, good) == []
