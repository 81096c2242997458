"""`mokv bench attention`'s bookkeeping that runs without a GPU: the
environment switches it times on a GPU (prefill and decode kernels, split
count), the tables' columns, and the KV formats' compile group."""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace

import click
import pytest
from click.testing import CliRunner
from max.dtype import DType

from mokv_examples.bench.attention import (
    LONG_PREFILL,
    MEMORY_BOUND_BYTES,
    PREFILL_KERNEL,
    SPLIT_SWEEP,
    attention,
    chosen_variants,
    to_markdown,
    with_variable,
)
from mokv_examples.bench.attention_cases import LLAMA, ONE_KV_HEAD
from mokv_examples.bench.attention_kernels import DECODE_VARIANTS, Kernels, decode_variants
from mokv_examples.bench.kv_formats import FormatKernels, format_cases, formats_markdown

ROW = {
    "device": "gpu",
    "kv_bytes": 1,
    "mokv_s": 2e-3,
    "max_s": 1e-3,
    "speedup": 0.5,
    "kv_gbps": 1.0,
    "max_kv_gbps": 2.0,
    "copy_gbps": 3.0,
    "tokens_per_s": 4.0,
    "max_abs_diff": 1e-3,
    "new_tokens": 1,
}
"""A GPU row's fields; each test names its case and phase."""


def test_variable_is_set_for_the_call_and_restored(monkeypatch):
    monkeypatch.delenv(PREFILL_KERNEL, raising=False)
    assert with_variable(PREFILL_KERNEL, "wgmma", lambda: os.environ[PREFILL_KERNEL])() == "wgmma"
    assert PREFILL_KERNEL not in os.environ

    def fails():
        raise RuntimeError("kernel failed")

    monkeypatch.setenv(PREFILL_KERNEL, "mma")
    with pytest.raises(RuntimeError, match="kernel failed"):
        with_variable(PREFILL_KERNEL, "wgmma", fails)()
    assert os.environ[PREFILL_KERNEL] == "mma"


def test_rows_with_and_without_the_prefill_variants_fill_every_column():
    row = ROW | {"case": "prefill-x", "phase": "prefill"}
    hopper = row | {
        "case": "prefill-y",
        "mma_s": 1e-3,
        "mma_speedup": 1.0,
        "mma_max_abs_diff": 2e-3,
        "producer_s": 5e-4,
        "producer_speedup": 2.0,
        "producer_max_abs_diff": 3e-3,
    }
    lines = to_markdown([row, hopper], "## header").splitlines()
    table = [line for line in lines if line.startswith("|")]
    assert len({line.count("|") for line in table}) == 1  # header, rule and rows alike
    assert "| mma.sync ms |" in table[0] and "| producer-fed ms |" in table[0]
    assert table[-1].endswith("| 1.000 | 1.00x | 2.0e-03 | 0.500 | 2.00x | 3.0e-03 |")
    text = "\n".join(lines)
    assert "MOKV_PREFILL_KERNEL=mma (Hopper), speedup over MAX: min 1.00, median 1.00, max 1.00 (1 case)" in text
    assert "MOKV_PREFILL_KERNEL=wgmma_producer (Hopper), speedup over MAX: min 2.00, median 2.00, max 2.00" in text
    without = [line for line in to_markdown([row], "## header").splitlines() if line.startswith("|")]
    assert "mma.sync" not in without[0] and {line.count("|") for line in without} == {11}


def test_decode_rows_with_the_decode_variants_fill_every_column():
    """`MOKV_DECODE_KERNEL=warp_heads` and `=warp_heads_8` beside the default
    decode: each variant's columns only where some row timed it, and its
    speedup and read rate in the summary."""
    row = ROW | {"case": "decode-x", "phase": "decode"}
    heads = row | {
        "case": "decode-y",
        "kv_bytes": MEMORY_BOUND_BYTES,
        "heads_s": 1e-3,
        "heads_speedup": 1.0,
        "heads_kv_gbps": 1.5,
        "heads_max_abs_diff": 2e-3,
    }
    heads8 = heads | {
        "case": "decode-z",
        "heads8_s": 5e-4,
        "heads8_speedup": 2.0,
        "heads8_kv_gbps": 2.4,
        "heads8_max_abs_diff": 1e-3,
    }
    lines = to_markdown([row, heads, heads8], "## header").splitlines()
    table = [line for line in lines if line.startswith("| ") or line.startswith("|-")][:5]
    assert len({line.count("|") for line in table}) == 1
    assert "| one head a warp ms | speedup | KV GB/s | max abs diff |" in table[0]
    assert table[0].endswith("| eight heads a block ms | speedup | KV GB/s | max abs diff |")
    assert table[-1].endswith("| 1.000 | 1.00x | 1.5 | 2.0e-03 | 0.500 | 2.00x | 2.4 | 1.0e-03 |")
    assert table[-2].endswith("| 1.000 | 1.00x | 1.5 | 2.0e-03 | | | | |")
    assert table[-3].endswith("| | | | | | | | |")
    text = "\n".join(lines)
    assert "decode with MOKV_DECODE_KERNEL=warp_heads, speedup over MAX: min 1.00" in text
    assert "where memory-bound: min 0.50" in text  # 1.5 GB/s over the copy's 3.0
    assert (
        "decode with MOKV_DECODE_KERNEL=warp_heads_8, speedup over MAX: min 2.00, median 2.00, max 2.00 (1 case)"
        in text
    )
    assert "where memory-bound: min 0.80" in text  # 2.4 GB/s over the copy's 3.0
    without = to_markdown([row], "## header")
    assert "one head a warp" not in without and "MOKV_DECODE_KERNEL" not in without


def test_gpu_summary_holds_each_case_to_issue_43s_target():
    """Prefill of 2k+ new tokens at MAX's speed, shorter chunks at 0.8x, the
    memory-bound decodes' KV read at 0.85 of the copy's traffic."""
    rows = [
        ROW | {"case": "prefill-long", "phase": "prefill", "new_tokens": LONG_PREFILL, "speedup": 0.7},
        ROW | {"case": "prefill-chunk", "phase": "prefill", "new_tokens": 512, "speedup": 0.9},
        ROW | {"case": "decode-long", "phase": "decode", "kv_bytes": MEMORY_BOUND_BYTES, "kv_gbps": 2.7},
    ]
    text = to_markdown(rows, "## header")
    assert "prefill of 2048+ new tokens, speedup over MAX (target >= 1): min 0.70, median 0.70, max 0.70" in text
    assert "prefill of fewer new tokens, speedup over MAX (target >= 0.8): min 0.90, median 0.90" in text
    assert "KV read rate / device copy traffic (target >= 0.85): min 0.90, median 0.90" in text


def test_decode_variants_are_timed_where_the_gpu_decode_takes_them():
    """A GPU's tensor-core decode (bfloat16 queries) over KV heads in whole
    blocks of each variant's; not on the CPU, over float32 queries, or over
    SmolLM2's three KV heads."""
    gpu, cpu = (SimpleNamespace(device=SimpleNamespace(is_host=host)) for host in (False, True))
    assert [v.kernel for v in decode_variants(gpu, (32, 8, 128), DType.bfloat16)] == ["warp_heads", "warp_heads_8"]
    assert [v.kernel for v in decode_variants(gpu, (16, 4, 128), DType.bfloat16)] == ["warp_heads"]
    assert decode_variants(cpu, (32, 8, 128), DType.bfloat16) == ()
    assert decode_variants(gpu, (32, 8, 128), DType.float32) == ()
    assert decode_variants(gpu, (9, 3, 64), DType.bfloat16) == ()
    assert len({v.key for v in DECODE_VARIANTS}) == len(DECODE_VARIANTS)


def test_kv_formats_with_each_decode_variant_get_its_table():
    """The KV formats' decodes also timed as each decode variant runs them:
    float8's tokens/s over bfloat16's with both so, each over its own
    default, a table per variant."""
    base = {
        "case": "decode-llama",
        "n_q_heads": 32,
        "n_kv_heads": 8,
        "head_dim": 128,
        "rows": "bfloat16",
        "bytes_per_token": 1,
        "decode_s": 2e-3,
        "tokens_per_s": 1.0,
        "kv_gbps": 1.0,
        "over_bfloat16": 1.0,
        "over_float32": 1.0,
        "max_abs_diff_vs_float32": 1e-3,
        "store_s": 1e-3,
        "store_over_float32": 1.0,
    }
    timed = {
        "bfloat16": {"decode_s": 1e-3, "over_default": 2.0, "over_bfloat16": 1.0},
        "float8_e4m3fn": {"decode_s": 5e-4, "over_default": 4.0, "over_bfloat16": 2.0},
    }

    def variant(key: str, kv_format: str) -> dict:
        fields = {"kv_gbps": 9.0, "max_abs_diff_vs_float32": 3e-3} | timed[kv_format]
        return {f"{key}_{name}": value for name, value in fields.items()}

    rows = [base | {"kv_format": f} | variant("heads", f) | variant("heads8", f) for f in timed]
    text = formats_markdown([base | {"kv_format": "float32"}, *rows], "## header", "gpu")
    for kernel in ("warp_heads", "warp_heads_8"):
        assert f"with MOKV_DECODE_KERNEL={kernel}, float8_e4m3fn decode tokens/s over bfloat16's: min 2.00" in text
        assert f"MOKV_DECODE_KERNEL={kernel} over each format's default decode: bfloat16 min 2.00" in text
    assert "Decode with one head a warp (`MOKV_DECODE_KERNEL=warp_heads`)" in text
    assert "| vs bf16 eight heads a block |" in text
    assert text.count("| decode-llama | float8_e4m3fn | 0.500 | 9.0 | 4.00x | 2.00x | 3.0e-03 |") == 2
    assert "MOKV_DECODE_KERNEL" not in formats_markdown([base | {"kv_format": "float32"}], "## header", "gpu")


def test_layout_probe_follows_llamas_cases_at_their_bytes():
    """On a GPU the formats time one KV head right after Llama's cases, at the
    bytes of Llama's largest batch at 8k; the CPU's cases have no probe."""
    for quick, batch in ((True, 16), (False, 32)):
        cases = format_cases(quick, gpu=True)
        probe = next(i for i, c in enumerate(cases) if c.heads == ONE_KV_HEAD)
        assert [c.heads for c in cases[:probe]] == [LLAMA] * probe
        llama = next(c for c in cases if c.heads == LLAMA and (c.batch, c.context) == (batch, 8192))
        assert cases[probe].batch * cases[probe].context == llama.batch * llama.context * LLAMA[1]
    assert all(c.heads != ONE_KV_HEAD for quick in (True, False) for c in format_cases(quick))


def test_layout_probe_is_compared_with_llama_and_kept_out_of_the_targets():
    """The probe's KV read over Llama's at the same bytes, per format, and its
    float8 ratio on a line of its own; the float8 target spans Llama's rows only."""
    heads = {"n_q_heads": 32, "n_kv_heads": 8, "head_dim": 128, "batch": 16, "context": 8192}
    probe = {"n_q_heads": 4, "n_kv_heads": 1, "head_dim": 128, "batch": 128, "context": 8192}
    base = {
        "rows": "bfloat16",
        "bytes_per_token": 1,
        "decode_s": 2e-3,
        "tokens_per_s": 1.0,
        "over_float32": 1.0,
        "max_abs_diff_vs_float32": 1e-3,
        "store_s": 1e-3,
        "store_over_float32": 1.0,
    }
    rows = [
        base | heads | {"case": "decode-llama", "kv_format": "bfloat16", "kv_gbps": 2000.0, "over_bfloat16": 1.0},
        base | heads | {"case": "decode-llama", "kv_format": "float8_e4m3fn", "kv_gbps": 1000.0, "over_bfloat16": 1.0},
        base | probe | {"case": "decode-4x1", "kv_format": "bfloat16", "kv_gbps": 3000.0, "over_bfloat16": 1.0},
        base | probe | {"case": "decode-4x1", "kv_format": "float8_e4m3fn", "kv_gbps": 2500.0, "over_bfloat16": 1.6},
    ]
    text = formats_markdown(rows, "## header", "gpu")
    assert (
        "float8_e4m3fn decode tokens/s over bfloat16 (target >= 1.8): min 1.00, median 1.00, max 1.00 (1 case)" in text
    )
    assert (
        "- one KV head (decode-4x1: its rows back to back in each page, as a head-major layout holds every"
        " head's), KV read over Llama's heads at the same bytes: bfloat16 1.50x, float8_e4m3fn 2.50x;"
        " float8_e4m3fn decode tokens/s over bfloat16 there: 1.60"
    ) in text
    assert "one KV head (" not in formats_markdown(rows[:2], "## header", "gpu")


def test_split_sweep_table_gives_each_count_over_the_planner():
    row = ROW | {"case": "decode-x", "phase": "decode"}
    swept = row | {"case": "decode-y", "splits_s": {"1": 4e-3, "2": 1e-3}}
    lines = to_markdown([row, swept], "## header").splitlines()
    sweep = lines[lines.index(next(line for line in lines if line.startswith("| case | planner ms"))) :]
    assert len({line.count("|") for line in sweep}) == 1
    assert sweep[-1] == "| decode-y | 2.000 | 2.00 | 0.50 |" + "  |" * (len(SPLIT_SWEEP) - 2)
    assert "planner ms" not in to_markdown([row], "## header")


def test_only_kv_formats_refuses_no_kv_formats():
    """The two say opposite things: refused before anything compiles."""
    result = CliRunner().invoke(attention, ["--only-kv-formats", "--no-kv-formats"])
    assert result.exit_code == 2
    assert "--only-kv-formats and --no-kv-formats exclude each other" in result.output


def test_prefill_variants_are_chosen_by_kernel_name():
    assert [v.key for v in chosen_variants("wgmma_producer")] == ["producer"]
    assert [v.key for v in chosen_variants(" mma , wgmma_producer ")] == ["mma", "producer"]
    assert chosen_variants("") == ()
    assert [v.key for v in chosen_variants("wgmma_tma,mma")] == ["tma", "mma"]
    with pytest.raises(click.BadParameter, match="wgmma: expected some of mma, wgmma_producer, wgmma_tma"):
        chosen_variants("mma,wgmma")


def test_unknown_prefill_variant_is_refused_before_anything_compiles():
    result = CliRunner().invoke(attention, ["--prefill-variants", "tensor"])
    assert result.exit_code == 2
    assert "tensor: expected some of mma, wgmma_producer, wgmma_tma" in result.output


def test_format_kernels_refuse_a_format_they_do_not_compile(session):
    """The formats' graphs compile as one group, so a format outside it is refused by
    name before anything compiles (the package path is never read)."""
    kernels = FormatKernels(Kernels(session, package=Path("not-built")), ("bfloat16",))
    with pytest.raises(KeyError, match="'int8' is not among this bench's formats"):
        kernels["int8"]
    assert kernels.models == {}
