"""The `max generate` and `max serve` commands the README and `docs/max-pipelines.md` give,
and those `mokv bench serve` starts (`ServeOptions`, on the CPU and on a GPU), as MAX reads
them: every option one MAX's own command line takes, and the weights found where MAX looks
for them (inside `--model-path`: a weight path written relative to the repository is not
found there). Parsing only: nothing compiles or runs."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
from max._entrypoints.pipelines import main as max_cli
from max.driver import DeviceSpec
from max.pipelines.lib import PipelineArgs, PipelineConfig

from mokv_examples.bench.serve import DEVICE_WEIGHTS
from mokv_examples.max_model import ensure_model_dir, weights_file
from mokv_examples.max_server import MOKV_ARCHITECTURE, ServeOptions

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


def _check_with_max(argv: list[str], model_dir: Path) -> dict:
    """`argv` (`generate ...` or `serve ...`) parsed by MAX's own command line and its
    weights resolved as MAX resolves them (the documents' model directory read as
    `model_dir`, mokv's cache being elsewhere in a test session); returns the parameters."""
    command = max_cli.get_command(None, argv[0])
    params = command.make_context(argv[0], argv[1:]).params  # unknown options and bad values raise here
    args = PipelineArgs.from_flat_kwargs(
        model_path=str(model_dir) if params["model_path"] == DOCUMENTED_MODEL_DIR else params["model_path"],
        weight_path=list(params["weight_path"]),
        device_specs=[DeviceSpec.cpu()],
    )
    assert PipelineConfig.from_args(args).model.weights_size() > 100_000_000  # found where MAX looks
    return params


@pytest.mark.parametrize(("document", "argv"), COMMANDS, ids=[f"{d}-{a[0]}-{i}" for i, (d, a) in enumerate(COMMANDS)])
def test_a_documented_command_is_one_max_takes(document: str, argv: list[str], max_model_dir: Path, monkeypatch):
    monkeypatch.chdir(REPO)
    params = _check_with_max(argv, max_model_dir)
    assert params["custom_architectures"] == ("mokv.pipelines.architecture",), document


@pytest.mark.parametrize("device", sorted(DEVICE_WEIGHTS))
def test_the_benchmarks_server_command_is_one_max_takes(device: str):
    encoding = DEVICE_WEIGHTS[device]
    model_dir = ensure_model_dir(encoding)
    options = ServeOptions(model_dir, weights_file(encoding), devices=device, encoding=encoding)
    params = _check_with_max(options.command(port=8000)[1:], model_dir)
    assert (params["devices"], params["quantization_encoding"]) == (device, encoding)
    assert params["custom_architectures"] == (MOKV_ARCHITECTURE,)
