"""The `max generate` and `max serve` commands the README and `docs/max-pipelines.md` give,
as MAX reads them: every option one MAX's own command line takes, and the weights found
where MAX looks for them (inside `--model-path`: a weight path written relative to the
repository is not found there). Parsing only: nothing compiles or runs."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
from max._entrypoints.pipelines import main as max_cli
from max.driver import DeviceSpec
from max.pipelines.lib import PipelineArgs, PipelineConfig

REPO = Path(__file__).resolve().parents[2]
DOCUMENTS = ("README.md", "docs/max-pipelines.md")
DOCUMENTED_MODEL_DIR = ".cache/max-model/SmolLM2-135M-Instruct"
"""Where `make max-model` writes the model directory with mokv's default cache."""


def _documented_commands() -> list[tuple[str, list[str]]]:
    """Each `max generate` / `max serve` line of the documents' bash blocks, its shell
    variables and line continuations expanded, comments dropped."""
    commands = []
    for document in DOCUMENTS:
        for block in re.findall(r"```bash\n(.*?)```", (REPO / document).read_text(), re.S):
            joined = block.replace("\\\n", " ")
            variables = dict(re.findall(r"\b([A-Z_]+)=(\S+)", " ".join(re.findall(r"export (.*)", joined))))
            for line in joined.splitlines():
                for name, value in variables.items():
                    line = line.replace(f"${name}", value)
                words = shlex.split(line, comments=True)
                if words[:1] == ["max"] and words[1:2] in (["generate"], ["serve"]):
                    commands.append((document, words[1:]))
    return commands


COMMANDS = _documented_commands()


def test_the_documents_give_both_commands():
    assert {words[0] for _, words in COMMANDS} == {"generate", "serve"}


@pytest.mark.parametrize(("document", "argv"), COMMANDS, ids=[f"{d}-{a[0]}-{i}" for i, (d, a) in enumerate(COMMANDS)])
def test_a_documented_command_is_one_max_takes(document: str, argv: list[str], max_model_dir: Path, monkeypatch):
    command = max_cli.get_command(None, argv[0])
    params = command.make_context(argv[0], argv[1:]).params  # unknown options and bad values raise here
    assert params["custom_architectures"] == ("mokv.pipelines.architecture",), document
    monkeypatch.chdir(REPO)
    model_path = params["model_path"].replace(DOCUMENTED_MODEL_DIR, str(max_model_dir))
    args = PipelineArgs.from_flat_kwargs(
        model_path=model_path, weight_path=list(params["weight_path"]), device_specs=[DeviceSpec.cpu()]
    )
    assert PipelineConfig.from_args(args).model.weights_size() > 100_000_000  # found where MAX looks
