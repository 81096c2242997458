"""GPU paths of mokv's ops: the same cache trait and semantics as the CPU
kernels, written as thread-block kernels (`block`) that launch on a device
context or run under a CPU emulator; `rows` stores and gathers, `attention`
is flash attention with split-K. These paths compile for sm_90 and gfx942
(`tools/check_gpu_build.sh`) and run under the emulator in the tests; they
have not yet run on a GPU."""
