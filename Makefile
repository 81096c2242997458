# The two commands: `make demo` runs the SmolLM2 demo, `make test` the whole suite.
# Each sets up what it needs on first use and is a no-op for set-up afterwards.

PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
# Compiled graphs and precompiled kernels live in the checkout, so warm reruns are fast.
export MODULAR_CACHE_DIR := $(CURDIR)/.cache/modular

.PHONY: setup model demo test bench bench-llama-cpp build constraints clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(VENV)/.installed: requirements.txt requirements-test.txt constraints.txt pyproject.toml | $(BIN)/python
	$(BIN)/pip install --disable-pip-version-check -q -c constraints.txt -r requirements-test.txt
	$(BIN)/pip install --disable-pip-version-check -q --no-deps -e .
	touch $@

setup: $(VENV)/.installed

model: setup
	$(BIN)/python -m mokv_graphs.model_files fetch

demo: model
	$(BIN)/mokv generate --max-new-tokens 48 \
		"What is the capital of France?" \
		"Write a haiku about caching." \
		"Explain what a KV cache is in one sentence."

test: model
	$(BIN)/python -m pytest -q

bench: model
	$(BIN)/mokv bench manager --quick
	$(BIN)/mokv bench attention --quick
	$(BIN)/mokv bench e2e --quick

# llama.cpp's column of the end-to-end benchmark: installs the optional llama-cpp-python
# extra first (it builds llama.cpp from source, about 8 minutes on 2 cores).
bench-llama-cpp: model
	$(BIN)/pip install --disable-pip-version-check -q -r requirements-bench.txt
	$(BIN)/mokv bench e2e --quick --against-llama-cpp

build: setup
	$(BIN)/python -c "from mokv.kernels import kernel_package; print(kernel_package())"

constraints: setup
	$(BIN)/pip freeze --exclude-editable | sed '1i # Transitive pins of the test environment (pip freeze); regenerate with `make constraints`.' > constraints.txt

clean:
	rm -rf .cache .pytest_cache
