"""Mojo kernels of mokv: KV cache layouts and the custom ops that use them."""
