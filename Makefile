# The two newcomer commands: `make demo` and `make test`. Each builds .venv from nothing the first time.
# torch is pinned to 2.13.0 and installed first: on a CPU machine that is the CPU build; GPU users install the
# CUDA build of torch 2.13 into .venv (or an active environment with VENV=...) before running these.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check -q

.PHONY: demo test lint install install-test clean

$(VENV)/.base: pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PIP) install torch==2.13.0
	$(PIP) install -e .
	touch $@

$(VENV)/.test: $(VENV)/.base Makefile
	$(PIP) install -e '.[test]'
	# Megatron-Core's own loss, run by tests/test_planner_system.py against the planner's sizing of it: its modules
	# need only torch and packaging, and its declared dependencies (nvidia-modelopt, wandb, zarr, ...) are not wanted
	$(PIP) install --no-deps megatron-core==0.12.0
	# nanotron's own loss, likewise (tests/test_planner_system.py loads its tensor-parallel functions on their own:
	# the package itself does not import without its training stack)
	$(PIP) install --no-deps nanotron==0.4
	touch $@

install: $(VENV)/.base
install-test: $(VENV)/.test

demo: $(VENV)/.base
	$(VENV)/bin/shardwise train --config configs/demo.toml

test: $(VENV)/.test
	$(PY) -m pytest -q --durations=25

lint: $(VENV)/.test
	$(PY) -m ruff check shardwise tests benchmarks

clean:
	rm -rf $(VENV) runs
