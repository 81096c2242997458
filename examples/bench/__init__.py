"""The `mokv bench` commands, apart from the user commands: each times mokv side by side with a
yardstick (MAX's own KV cache and kernels, llama.cpp, or mokv at another git revision) and writes
its results as JSON and markdown."""
