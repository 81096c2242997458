"""The raw pointers mokv's kernels pass around, each spelled once here.

Kernels reach MAX's tensors through raw pointers whose origin is untracked
(`MutUntrackedOrigin`): a struct field or a GPU kernel argument cannot hold a
tracked one.
"""

comptime CachePtr[dtype: DType] = Pointer[Scalar[dtype], MutUntrackedOrigin]
"""Elements of `dtype`: cache rows, and queries or outputs of the cache's dtype."""
comptime U32Ptr = Pointer[UInt32, MutUntrackedOrigin]
comptime ScalePtr = Pointer[Float32, MutUntrackedOrigin]
"""Float32 scales of a quantized cache (`cache.layout.ScaleTable`)."""
