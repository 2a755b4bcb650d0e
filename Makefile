# Two entry points for a fresh machine (see README):
#   make demo   set-up, then run the embedded default
#   make test   set-up, then the whole test suite
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: setup demo test lint clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# torch 2.13.0 first: its CPU build lies on this kind of machine's disk; a bare `torch`
# requirement resolved by pip alone would pull a multi-GB CUDA build.
setup: $(BIN)/python
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test]'

# The embedded default: tiny preset, 1 prefill + 1 decode worker, store and Conductor in the
# frontend, OpenAI API on http://127.0.0.1:8000 (Ctrl-C stops it and every worker).
demo: setup
	$(BIN)/kvcake serve

test: setup
	$(BIN)/python -m pytest -q

lint: setup
	$(BIN)/ruff check kvcake tests benchmarks
	$(BIN)/mypy kvcake

clean:
	rm -rf $(VENV) build *.egg-info
