#!/usr/bin/env bash
# Compiles here, for Hopper (MAX's virtual device mode, tools/compile_gpu_graphs.py),
# the Mojo kernels the prepared GPU run compiles there, and packs them into
# .gpu-warm/modular.tar.gz for its calls to carry, with the precompiled kernel
# packages: tools/gpu_proof.sh unpacks them into its caches before its first step.
#
# Why: compiling took most of a GPU run's minutes (the tenth run's benchmark timed
# nothing for its first 92 s, its KV-formats step for 141 of its 159 s), and MAX's
# cache keys a compiled Mojo kernel by its contents, not by the path of its package
# or of MAX itself: here, from this archive alone, a checkout elsewhere with MAX
# installed elsewhere compiled these graphs in 200 s where an empty cache took
# 994 s (tests/gpu/README.md, 2026-11-30). What stays is MAX's own per-graph work. The
# compiled graphs themselves (MAX's `.max_cache`) are left out: their key holds
# the packages' paths, and so would miss there.
#
# Families: the GPU tests' attention, store_gather, quantized and SmolLM2 graphs,
# the KV formats, the quick benchmark (mokv's graph and MAX's), the profile's
# float8 decode; and where .gpu-previous/ holds the previous kernels
# (tools/gpu_previous.sh), the KV formats over them (the proof's
# COMPARE_STEP=formats), from a copy of this checkout with them in place. 13 to 17
# minutes on a 2-core machine (43 MB since the decodes of one KV head a warp).
#
# The ops' host side is compiled for HOST_CPU (an LLVM CPU, default x86-64-v3), not
# for this machine's processor, which would enter its key; the archive names it in
# host-cpu, and the proof pins the GPU machine's Python to it (tools/pin_host_cpu.sh).
#
# Usage: tools/gpu_warm_cache.sh    (after tools/gpu_previous.sh, if the run compares)
# The archive is for this checkout's kernels: remake it after changing mojo/.
set -euo pipefail
cd "$(dirname "$0")/.."

DEST=.gpu-warm
HOST_CPU=${HOST_CPU:-x86-64-v3}
PY=${PYTHON:-.venv/bin/python}
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
# SmolLM2's weights, where this checkout keeps them (its graphs are built from them).
models=$("$PY" -c "from mokv.paths import cache_dir; print(cache_dir() / 'models')")
"$PY" -m mokv_models.model_files fetch > /dev/null
# As the proof lays them out there: MAX's cache inside mokv's.
export MOKV_CACHE_DIR=$WORK/cache MODULAR_CACHE_DIR=$WORK/cache/modular
mkdir -p "$MOKV_CACHE_DIR" && ln -s "$models" "$MOKV_CACHE_DIR/models"
revision=$(git log -1 --format=%h -- mojo)$(git diff --quiet HEAD -- mojo || echo "+changes")

"$PY" tools/compile_gpu_graphs.py --host-cpu "$HOST_CPU" attention store_gather quantized formats bench profile smollm2
compared=""
if [ -d .gpu-previous/mokv_kernels ]; then
    # The checkout's Python over the previous kernels, linked as the proof's install
    # links them.
    copy=$WORK/previous site=$WORK/site
    mkdir -p "$copy" "$site"
    cp -R python graphs examples reference tests tools mojo "$copy/"
    rm -rf "$copy/mojo/mokv_kernels" && cp -R .gpu-previous/mokv_kernels "$copy/mojo/mokv_kernels"
    tools/link_packages.sh "$site" "$copy"
    echo "the previous kernels (.gpu-previous/mokv_kernels):"
    PYTHONPATH=$site "$PY" "$copy/tools/compile_gpu_graphs.py" --host-cpu "$HOST_CPU" formats
    compared=", and the KV formats over .gpu-previous/mokv_kernels"
fi

mkdir -p "$DEST"
echo "$HOST_CPU" > "$DEST/host-cpu"
# The precompiled kernel packages too (mokv.kernels, by their sources' digest).
tar czf "$DEST/modular.tar.gz" -C "$MOKV_CACHE_DIR" modular/.mojo_cache mojo
echo "Mojo kernels compiled for sm_90a (host side for $HOST_CPU) at $revision on $(date -u +%F): the GPU tests' families," \
    "SmolLM2's, the KV formats, the quick benchmark and the profile$compared" > "$DEST/made.txt"
echo "$DEST/modular.tar.gz: $(du -h "$DEST/modular.tar.gz" | cut -f1); $(cat "$DEST/made.txt")"
# A call carries at most 64 MiB with the checkout and .gpu-previous.
if [ "$(stat -c %s "$DEST/modular.tar.gz")" -gt $((56 * 1024 * 1024)) ]; then
    echo "$DEST/modular.tar.gz is over 56 MiB: with the checkout it would not travel in one call" >&2
    exit 1
fi
