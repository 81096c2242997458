"""Independent references that tests and benchmarks compare mokv against: numpy
models of the cache and attention, and MAX's own KV cache and kernels (the only
place in the project that imports them)."""
