"""GPU paths of mokv's ops: the same cache trait and semantics as the CPU
kernels, written as thread-block kernels (`block`) that launch on a device
context or run under a CPU emulator. `rows` stores and gathers; `attention`
is the attention package (plan, decode, prefill, merge, op). These paths
compile for sm_90 and gfx942 (`tools/check_gpu_build.sh`) and run under the
emulator in the tests (`tests/gpu/README.md`)."""
