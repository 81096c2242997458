"""GPU paths of mokv's ops: the same cache trait and semantics as the CPU
kernels, written as thread-block kernels (`block`) that launch on a device
context or run under a CPU emulator. `rows` stores and gathers; attention is
`attention` (entry point, plan, prefill tile kernel, split-K merge) with
`decode` (flash decoding), `attention_work` (a block's rows and context
range) and `tile_softmax` (the online softmax both kernels share). These
paths compile for sm_90 and gfx942 (`tools/check_gpu_build.sh`), run under
the emulator in the tests, and have run on an H200 (`tests/gpu/README.md`)."""
