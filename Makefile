# kxpu — every target does its own set-up on a fresh machine (they depend on `dev`).
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-stamp

.PHONY: dev test lint unit e2e demo bench proto clean

dev: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $@

## Everything CI runs.
test: lint unit

lint: dev
	$(BIN)/ruff check kxpu tests bench hack
	$(BIN)/ruff format --check kxpu tests bench hack
	$(BIN)/mypy
	$(BIN)/python hack/genproto.py --check

unit: dev
	$(BIN)/pytest tests -q

## The main job on simulated devices: the node daemon against a kubelet stand-in.
demo: dev
	$(BIN)/python hack/demo.py

bench: dev
	$(BIN)/python bench/bench_daemon.py
	$(BIN)/python bench/bench_nvidia.py

## Regenerate kxpu/api from its .proto files (committed; `lint` checks they are current).
proto: dev
	$(BIN)/python hack/genproto.py

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache *.egg-info
