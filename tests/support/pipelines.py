"""Settings the tests of mokv inside MAX's own pipelines share: the model's weights and the
one `max serve` per session (its page size, batch and context)."""

from __future__ import annotations

MAX_MODEL_ENCODING = "float32"
"""The weights the pipeline tests load (exact: the GGUF dequantized)."""

SERVE_PAGE_SIZE = 128
"""MAX's default page size (MAX's own manager takes multiples of 128 only)."""

SERVE_MAX_BATCH, SERVE_MAX_LENGTH = 8, 1024
"""The server's batch and context: its pool holds a full batch of contexts, 64 float32
pages (~380 MB), and a 1024-token context leaves room to refuse a longer prompt cheaply.
The `max generate` test runs with the same page size, batch and context, so the server's
graph is the one that test compiled (MAX's cache serves it)."""
