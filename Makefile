# The two commands: `make demo` runs the SmolLM2 demo, `make test` the whole suite.
# Each sets up what it needs on first use and is a no-op for set-up afterwards.

PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
# mokv's caches (precompiled kernels, model files, wheels) and MAX's compiled graphs
# live in the checkout, so warm reruns are fast; an installed mokv caches per user.
export MOKV_CACHE_DIR := $(CURDIR)/.cache
export MODULAR_CACHE_DIR := $(MOKV_CACHE_DIR)/modular
WHEELS := $(MOKV_CACHE_DIR)/wheels

.PHONY: setup model max-model wheels demo test lint gpu-build-check bench bench-llama-cpp build constraints clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# The .pth line points the checkout's venv at the checkout's caches however it is
# started (.venv/bin/mokv, .venv/bin/python -m pytest), as make does.
$(VENV)/.installed: requirements.txt requirements-cli.txt requirements-remote.txt requirements-test.txt constraints.txt pyproject.toml reference/pyproject.toml | $(BIN)/python
	$(BIN)/pip install --disable-pip-version-check -q -c constraints.txt -r requirements-test.txt
	$(BIN)/pip install --disable-pip-version-check -q --no-deps -e . -e reference
	echo 'import os; os.environ.setdefault("MOKV_CACHE_DIR", "$(MOKV_CACHE_DIR)")' \
		> "$$($(BIN)/python -c 'import sysconfig; print(sysconfig.get_path("purelib"))')/mokv_checkout_cache.pth"
	touch $@

setup: $(VENV)/.installed

model: setup
	$(BIN)/python -m mokv_models.model_files fetch

# SmolLM2 as a model directory MAX's own `max generate` / `max serve` load (float32 GGUF,
# config.json, tokenizer), for `--custom-architectures mokv.pipelines.architecture`.
MAX_MODEL := $(MOKV_CACHE_DIR)/max-model/SmolLM2-135M-Instruct
$(MAX_MODEL)/config.json: | model
	$(BIN)/mokv max-model $(MAX_MODEL)

max-model: $(MAX_MODEL)/config.json

# What a fresh install of mokv's wheel needs (its pinned dependencies and the build
# backend), so the packaging test installs into a new virtualenv without the network.
$(WHEELS)/.mokv-install: requirements.txt constraints.txt | $(BIN)/python
	$(BIN)/pip download --disable-pip-version-check -q --only-binary=:all: -d $(WHEELS) \
		-c constraints.txt -r requirements.txt "setuptools>=68"
	touch $@

wheels: $(WHEELS)/.mokv-install

demo: model
	$(BIN)/mokv generate --max-new-tokens 48 \
		"What is the capital of France?" \
		"Write a haiku about caching." \
		"Explain what a KV cache is in one sentence."

test: model wheels
	$(BIN)/python -m pytest -q -n 2 --no-loadscope-reorder --durations=25

# What CI checks before the tests: Python lint and formatting, Mojo formatting.
lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	tools/check_mojo_format.sh

# Every GPU path of the ops compiled to device code for sm_90 and gfx942 (no GPU needed).
gpu-build-check: setup
	tools/check_gpu_build.sh

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
