#!/usr/bin/env bash
# The previous kernels, for tools/gpu_proof.sh to time beside the current ones:
# mojo/mokv_kernels as it was at REV (default: the commit before the GPU
# attention package was split, 8d282f0), in .gpu-previous/mokv_kernels (git
# ignores it: name it in the device call's `carry`). Then
#   COMPARE="mojo/mokv_kernels=.gpu-previous/mokv_kernels" tools/gpu_proof.sh
# runs the benchmark once with them in place of the current tree. The whole
# package is swapped, so it must still match the Python op wrappers of the
# checkout (op names and their inputs). Links into other Mojo packages of REV
# (parallel.mojo, pointers.mojo) are copied as the files they point to.
set -euo pipefail
cd "$(dirname "$0")/.."
REV=${1:-8d282f0}
rm -rf .gpu-previous
mkdir -p .gpu-previous
tree=$(mktemp -d)
trap 'rm -rf "$tree"' EXIT
git archive "$REV" mojo | tar -x -C "$tree"
cp -rL "$tree/mojo/mokv_kernels" .gpu-previous/
echo "mojo/mokv_kernels at $(git rev-parse --short "$REV") in .gpu-previous/mokv_kernels"
