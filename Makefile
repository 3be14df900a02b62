# kxpu — every target does its own set-up on a fresh machine (they depend on `dev`).
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-stamp

.PHONY: dev test lint unit e2e demo bench proto clean helm helm-check manifests image image-lock

dev: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $@

## Everything CI runs.
test: lint unit helm-check

lint: dev
	$(BIN)/ruff check kxpu tests bench hack deploy
	$(BIN)/ruff format --check kxpu tests bench hack deploy
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

## helm, built from its Go module and cached by version (first build ~3.5 min).
helm:
	hack/helm/build.sh

## helm lint + template with default and override values, chart/dashboard/image tests.
helm-check: dev helm
	$(BIN)/pytest deploy/tests -q

## Plain manifests rendered from the chart (deploy/manifests).
manifests: helm
	hack/helm/manifests.sh

## The kxpu image as an OCI archive (out/kxpu-image.tar), without a container engine (root).
image: dev
	hack/image/build.sh

## Re-pin the image's Python dependencies after pyproject.toml changes.
image-lock: dev
	$(BIN)/python hack/image/lock.py

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache *.egg-info
