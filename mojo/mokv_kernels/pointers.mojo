"""The raw pointers mokv's kernels pass around, each spelled once here.

Kernels reach MAX's tensors through raw pointers whose origin is untracked
(`MutUntrackedOrigin`): a struct field or a GPU kernel argument cannot hold a
tracked one. Both Mojo packages use these: `mokv_weights/pointers.mojo` links
to this file (a copy in a wheel), as `mokv_kernels/parallel.mojo` links to
`mokv_weights/parallel.mojo`, because each package is precompiled on its own.
"""

comptime CachePtr[dtype: DType] = Pointer[Scalar[dtype], MutUntrackedOrigin]
"""Elements of `dtype`: cache rows, or any tensor's elements (queries, outputs, new rows)."""
comptime BytePtr = Pointer[UInt8, MutUntrackedOrigin]
comptime U32Ptr = Pointer[UInt32, MutUntrackedOrigin]
comptime F16Ptr = Pointer[Float16, MutUntrackedOrigin]
comptime BF16Ptr = Pointer[BFloat16, MutUntrackedOrigin]
comptime F32Ptr = Pointer[Float32, MutUntrackedOrigin]
comptime ScalePtr = F32Ptr
"""Float32 scales of a quantized cache (`cache.layout.ScaleTable`)."""
