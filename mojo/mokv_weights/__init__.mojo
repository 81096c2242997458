"""Weight kernels of mokv: matmuls and embedding lookups over GGUF blocks.

Its ops are registered as `mokv_quant.matmul` and `mokv_quant.gather_rows`:
the package's former name, kept because graphs call the ops by these names."""
