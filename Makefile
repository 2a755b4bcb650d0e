# Two entry points for a fresh machine (see README):
#   make demo   set-up, then run the embedded default
#   make test   set-up, then the whole test suite
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: setup sysdeps demo test lint clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# torch 2.13.0 first: its CPU build lies on this kind of machine's disk; a bare `torch`
# requirement resolved by pip alone would pull a multi-GB CUDA build.
setup: $(BIN)/python
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test]'
	$(BIN)/python -m kvcake.engine.cpu_ops || echo "kvcake: CPU ops not built (no C++ compiler?); the engine falls back to plain torch ops"

# What the tests use beyond Python, from Debian's packages: etcd (membership and store-master
# failover), iproute2 (hosts as network namespaces, tc) and g++ (the engine's CPU ops). Installed
# only when missing and when we are root; otherwise the tests that need them skip and say why.
SYSDEPS := etcd:etcd-server ip:iproute2 g++:g++
sysdeps:
	@missing=""; for pair in $(SYSDEPS); do cmd=$${pair%%:*}; pkg=$${pair#*:}; \
	  command -v $$cmd >/dev/null 2>&1 || missing="$$missing $$pkg"; done; \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    echo "installing:$$missing"; apt-get update -q >/dev/null && \
	    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends $$missing >/dev/null; \
	  else echo "not installed:$$missing (tests that need them will skip)"; fi; fi

# The embedded default: tiny preset, 1 prefill + 1 decode worker, store and Conductor in the
# frontend, OpenAI API on http://127.0.0.1:8000 (Ctrl-C stops it and every worker).
demo: setup
	$(BIN)/kvcake serve

test: setup sysdeps
	$(BIN)/python -m pytest -q

lint: setup
	$(BIN)/ruff check kvcake tests benchmarks
	$(BIN)/mypy kvcake

clean:
	rm -rf $(VENV) build *.egg-info
