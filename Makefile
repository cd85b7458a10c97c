# KnitTrans: `make repro` runs every paper table on the embedded defaults; `make test` runs the test suite.
# Both create .venv on first use (CPU torch 2.13.0 from the local wheel; never a multi-GB CUDA build).
SHELL := /bin/bash
PYTHON ?= python3.11
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-$(shell sha1sum pyproject.toml | cut -c1-12)

# No network at run time: no hub downloads, W&B offline, Triton interpreted on CPU, Ray without auth.
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export WANDB_MODE ?= offline
export WANDB_SILENT := true
export RAY_AUTH_MODE := disabled
export RAY_USAGE_STATS_ENABLED := 0
export TRITON_INTERPRET ?= 1
export PIP_DISABLE_PIP_VERSION_CHECK := 1
export PYTHONUNBUFFERED := 1

TABLES ?= staleness kernels transfer

.PHONY: all setup test gate repro bench clean

all: test

$(STAMP):
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@echo "installing into $(VENV) (log: $(VENV)/pip.log)"
	$(PY) -m pip install -q "torch==2.13.0" >$(VENV)/pip.log 2>&1 || { cat $(VENV)/pip.log; exit 1; }
	$(PY) -m pip install -q -e ".[dev,ray]" >>$(VENV)/pip.log 2>&1 || { cat $(VENV)/pip.log; exit 1; }
	$(PY) -c "import torch, knittrans; print('torch', torch.__version__)"
	@touch $(STAMP)

setup: $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q -m "not slow" tests

gate: $(STAMP)
	$(PY) -m repro.gate

repro: $(STAMP)
	@for t in $(TABLES); do echo "== repro.$$t"; $(PY) -m repro.$$t || exit 1; done
	$(PY) -m repro.report

bench: $(STAMP)
	$(PY) -m pytest -q tests/bench --benchmark-enable --benchmark-only

clean:
	rm -rf $(VENV) results outputs wandb .benchmarks .pytest_cache .hypothesis
