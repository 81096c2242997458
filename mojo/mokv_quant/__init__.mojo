"""Weight kernels of mokv: matmuls and embedding lookups over GGUF blocks."""
