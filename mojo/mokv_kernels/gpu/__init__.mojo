"""GPU paths of mokv's ops: the same cache trait and semantics as the CPU
kernels, written as thread-block kernels (`block`) that launch on a device
context or run under a CPU emulator, warp-collective steps included (`warp`:
tensor-core fragments, `ldmatrix`, shuffles). `rows` stores and gathers,
`quantized` does so for 8-bit caches (`codes` reads their elements);
`attention` is the attention package (plan, decode, prefill, tensor-core
tiles, merge, op). Hopper's building blocks: `warpgroup` (its warpgroup
products, `wgmma`), `mbarrier` (barriers between warps that do different
work) and `tensor_map` (rows copied by the tensor memory accelerator).
`shared_memory` is the block's shared memory, `swizzle` the layout of
every tensor-core tile in it, and `copy` starts asynchronous 16-byte copies
into it; `views` lays op tensors over raw
memory, so the compile check and the emulator call the ops' entry points.
These paths compile for sm_90 and gfx942 (`tools/check_gpu_build.sh`) and
run under the emulator in the tests (`tests/gpu/README.md`)."""
