"""`mokv bench weights`: the candidates for holding SmolLM2's weights in the graph, on the
real shapes: every matrix product of one step (30 layers x 7 projections and the LM head,
each weight distinct, so the compiler cannot merge them) in one graph per candidate, timed
alternately call by call at several token counts.

- `f32`: float32 weights, MAX's `matmul` (the reference format);
- `gguf`: the GGUF's own Q4_1 / Q8_0 blocks, mokv's `mokv_quant.matmul` (float32
  activations, weights dequantized in registers);
- `q4_0`: the weights requantized to Q4_0 (MAX 26.7's `qmatmul` reads neither Q4_1 nor
  Q8_0), MAX's `qmatmul`, which rounds the activations to int8;
- `bf16`: bfloat16 weights and activations, MAX's `matmul`.

Each case also reports how far the candidate's output is from float64 `x @ w.T` of the
float32 weights, relative to the output's largest magnitude.

`--against REV` adds `gguf@REV`: the `gguf` products with `mokv_weights` as of git revision
`REV`, rebuilt from git's copy, in its own session (both builds register the same op names)
and timed alternately with this checkout's: the way to measure a kernel change, since separate
runs on a shared machine differ by more than most changes are worth. Revisions before 69fdb03
read the GGUF's interleaved rows, not the planar ones the loader now writes: their error
column shows it.
"""

from __future__ import annotations

import functools
import tempfile
import time
from pathlib import Path

import click
import gguf
import numpy as np
from max.driver import CPU as HostCPU
from max.driver import Buffer
from max.dtype import DType
from max.engine import InferenceSession, Model
from max.graph import DeviceRef, Graph, TensorType, TensorValue, Weight, ops
from max.graph.quantization import QuantizationEncoding

from mokv.kernels import kernel_package
from mokv_examples.bench.results import out_dir_option, write_results
from mokv_examples.bench.revisions import kernel_sources_at
from mokv_examples.bench.timing import time_rounds
from mokv_models.gguf_model import LlamaCheckpoint, load_llama
from mokv_models.weight_formats import QUANT_KERNELS, declare_weight, linear, quant_kernel_package

CPU = DeviceRef.CPU()
CANDIDATES = ("f32", "gguf", "q4_0", "bf16")
NORM_EPS = 1e-6
"""Each layer of the chain ends in an RMS norm, as the model's do: without one the chain grows
layer by layer until float32 (and the float64 reference's SiLU) overflow."""
PROJECTIONS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


def _bfloat16(a: np.ndarray) -> Buffer:
    """`a` rounded to bfloat16 (nearest, ties to even)."""
    bits = np.ascontiguousarray(a, np.float32).view(np.uint32)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
    return Buffer.from_numpy(rounded).view(DType.bfloat16)


def candidate_linear(candidate: str, f32: LlamaCheckpoint, blocks: LlamaCheckpoint, registry: dict):
    """`(x, name) -> x @ W.T` for `candidate`, filling `registry` with the arrays it binds."""

    def product(x: TensorValue, name: str) -> TensorValue:
        w = np.asarray(f32.weights[name])
        rows, columns = w.shape
        if candidate == "gguf":
            registry[name] = blocks.weights[name]
            return linear(x, declare_weight(name, blocks.encodings[name], rows, columns, CPU), blocks.encodings[name])
        if candidate == "f32":
            registry[name] = w
            return ops.matmul(x, ops.transpose(Weight(name, DType.float32, [rows, columns], CPU), 0, 1))
        if candidate == "q4_0":
            registry[name] = gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q4_0)
            weight = Weight(name, DType.uint8, list(registry[name].shape), CPU)
            return ops.qmatmul(QuantizationEncoding.Q4_0, None, x, weight)
        registry[name] = _bfloat16(w.T)
        weight = Weight(name, DType.bfloat16, [columns, rows], CPU)
        return ops.cast(ops.matmul(ops.cast(x, DType.bfloat16), weight), DType.float32)

    return product


def products_graph(
    candidate: str, f32: LlamaCheckpoint, blocks: LlamaCheckpoint, quant_kernels: Path | None = None
) -> tuple[Graph, dict]:
    """One step's matrix products, chained so that none is dead code: `x [tokens, hidden]
    -> (layer outputs..., logits)`; `gguf` products run `quant_kernels` (default: this
    checkout's `mokv_weights`)."""
    registry: dict = {}
    product = candidate_linear(candidate, f32, blocks, registry)
    c = f32.config
    extensions = [quant_kernels or quant_kernel_package()] if candidate == "gguf" else []
    with Graph(
        f"weights_{candidate}",
        input_types=[TensorType(DType.float32, ["tokens", c.hidden_size], CPU)],
        custom_extensions=extensions,
    ) as graph:
        x = graph.inputs[0].tensor
        ones = ops.constant(np.ones(c.hidden_size, np.float32), DType.float32, CPU)
        for i in range(c.n_layers):
            q, k, v = (product(x, f"blk.{i}.{p}.weight") for p in PROJECTIONS[:3])
            attn = product(q, f"blk.{i}.attn_output.weight")
            gate, up = (product(x, f"blk.{i}.{p}.weight") for p in ("ffn_gate", "ffn_up"))
            down = product(ops.silu(gate) * up, f"blk.{i}.ffn_down.weight")
            x = ops.rms_norm(x + 0.1 * (attn + down + k[:, :1] + v[:, :1]), ones, NORM_EPS)
        graph.output(product(x, c.lm_head_name))
    return graph, registry


def reference_logits(f32: LlamaCheckpoint, x: np.ndarray) -> np.ndarray:
    """The same chain in float64 numpy."""
    w = {name: np.asarray(a, np.float64) for name, a in f32.weights.items()}
    x = x.astype(np.float64)
    for i in range(f32.config.n_layers):
        p = f"blk.{i}."
        q, k, v = (x @ w[p + n + ".weight"].T for n in PROJECTIONS[:3])
        attn = q @ w[p + "attn_output.weight"].T
        gate, up = x @ w[p + "ffn_gate.weight"].T, x @ w[p + "ffn_up.weight"].T
        down = (gate / (1 + np.exp(-gate)) * up) @ w[p + "ffn_down.weight"].T
        x = x + 0.1 * (attn + down + k[:, :1] + v[:, :1])
        x = x / np.sqrt((x * x).mean(axis=-1, keepdims=True) + NORM_EPS)
    return x @ w[f32.config.lm_head_name].T


@click.command("weights")
@click.option("--tokens", default="1,16,500", show_default=True, help="Token counts (rows of x) to time.")
@click.option("--candidates", default=",".join(CANDIDATES), show_default=True)
@click.option("--rounds", default=10, show_default=True)
@click.option(
    "--against", "revision", default=None, help="Also time the gguf products with mokv_weights as of this git revision."
)
@out_dir_option("weights")
def weights(tokens: str, candidates: str, rounds: int, revision: str | None, out_dir: Path) -> None:
    """Time one step's matrix products with each weight format candidate."""
    chosen = [c.strip() for c in candidates.split(",")]
    unknown = set(chosen) - set(CANDIDATES)
    if unknown:
        raise click.BadParameter(f"unknown candidates {sorted(unknown)}; choose from {', '.join(CANDIDATES)}")
    builds = [(c, c, None) for c in chosen]  # (name, candidate, mokv_weights package)
    if revision is not None:
        with tempfile.TemporaryDirectory() as tmp:
            package = kernel_package(kernel_sources_at(revision, Path(tmp), QUANT_KERNELS))
        builds.append((f"gguf@{revision}", "gguf", package))
    f32, blocks = load_llama(weights="f32"), load_llama(weights="gguf")
    session = InferenceSession(devices=[HostCPU()])
    models: dict[str, Model] = {}
    for name, candidate, package in builds:
        started = time.perf_counter()
        graph, registry = products_graph(candidate, f32, blocks, package)
        own_session = session if package is None else InferenceSession(devices=[HostCPU()])
        models[name] = own_session.load(graph, weights_registry=registry)
        click.echo(f"{name}: graph ready in {time.perf_counter() - started:.0f} s", err=True)
    rows = []
    for count in (int(t) for t in tokens.split(",")):
        x = np.random.default_rng(count).standard_normal((count, f32.config.hidden_size)).astype(np.float32)
        expected = reference_logits(f32, x[: min(count, 4)])
        errors = {}
        for name, model in models.items():
            got = model.execute(Buffer.from_numpy(x))[0].to_numpy()[: len(expected)]
            errors[name] = float(np.abs(got - expected).max() / np.abs(expected).max())
        x_buffer = Buffer.from_numpy(x)
        calls = {name: functools.partial(model.execute, x_buffer) for name, model in models.items()}
        times = time_rounds(calls, rounds if count < 100 else max(3, rounds // 3))
        for name in models:
            macs = count * sum(np.asarray(f32.weights[n]).size for n in f32.weights if f32.weights[n].ndim == 2)
            rows.append(
                {
                    "tokens": count,
                    "candidate": name,
                    "ms": times[name] * 1e3,
                    "gmac_per_s": macs / times[name] / 1e9,
                    "relative_error": errors[name],
                }
            )
            click.echo(
                f"tokens {count:4d} {name:>5}: {times[name] * 1e3:8.2f} ms, {rows[-1]['gmac_per_s']:6.1f} GMAC/s, "
                f"error {errors[name]:.1e}",
                err=True,
            )
    header = "| tokens | candidate | ms per step | GMAC/s | max error / max logit |\n|---|---|---|---|---|\n"
    lines = [
        f"| {r['tokens']} | {r['candidate']} | {r['ms']:.2f} | {r['gmac_per_s']:.1f} | {r['relative_error']:.1e} |"
        for r in rows
    ]
    write_results(out_dir, "weights", rows, header + "\n".join(lines) + "\n")
