# kxpu — every target does its own set-up on a fresh machine (they depend on `dev`).
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-stamp

.PHONY: dev test lint unit unit-newest e2e demo demo-standin bench proto clean helm helm-check manifests chart image image-lock \
	cluster-build cluster-up cluster-down
ROOT   := $(shell id -u)
# The oldest Kubernetes release kxpu supports (hack/cluster/k8s/<release>); the newest is the default everywhere.
OLDEST_K8S := 1.34

dev: $(STAMP)

# Exactly the hash-pinned packages of hack/dev-requirements.txt (`make image-lock` rewrites it), then kxpu itself,
# editable, built with the locked setuptools (no build isolation: nothing unpinned is fetched).
$(STAMP): pyproject.toml hack/dev-requirements.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --disable-pip-version-check --only-binary=:all: --require-hashes \
		-r hack/dev-requirements.txt
	$(BIN)/python -m pip install --quiet --disable-pip-version-check --no-deps --no-build-isolation -e .
	$(BIN)/python -m compileall -q kxpu  # the first daemon start (an e2e run's) finds its bytecode
	touch $@

## Everything CI runs.
test: lint unit unit-newest helm-check e2e

lint: dev
	$(BIN)/ruff check kxpu tests bench hack deploy e2e
	$(BIN)/ruff format --check kxpu tests bench hack deploy e2e
	$(BIN)/mypy
	$(BIN)/python hack/genproto.py --check

unit: dev
	$(BIN)/pytest tests -q

## The resource lifecycle (start, failure and retry, stop, reload; device plugin and DRA) on the newest Python
## kxpu supports as well (Debian trixie's 3.13 in a chroot cached in /var/cache/kxpu; `unit` runs the oldest,
## 3.11): asyncio's cancellation semantics differ between them. As root; about 2 min cold, 1 min cached.
NEWEST_TESTS := tests/test_resource_runner.py tests/test_dra_recovery.py tests/test_daemon_robustness.py \
	tests/test_dra_daemon.py
unit-newest: dev
ifeq ($(ROOT),0)
	hack/newest-python.sh $(NEWEST_TESTS) -q
else
	@echo "unit-newest skipped: it needs root (a Debian trixie chroot with the newest Python)"
endif

## The main job on simulated devices. As root: kxpu on the real single-node cluster (built once, ~15 min);
## otherwise, and with `make demo-standin`: the node daemon against the kubelet stand-in (seconds, no root).
demo: dev
ifeq ($(ROOT),0)
	hack/cluster/build.sh all
	PYTHONPATH=$(CURDIR) $(BIN)/python hack/demo_cluster.py
else
	$(BIN)/python hack/demo.py
endif

demo-standin: dev
	$(BIN)/python hack/demo.py

bench: dev
	$(BIN)/python bench/bench_daemon.py
	$(BIN)/python bench/bench_startup.py --libs-floor
	$(BIN)/python bench/bench_allocate.py
	$(BIN)/python bench/bench_nvidia.py
	$(BIN)/python bench/bench_telemetry.py
	$(BIN)/python bench/bench_amd.py
	$(BIN)/python bench/bench_dra_prepare_cpu.py
ifeq ($(ROOT),0)
	hack/cluster/build.sh k8s
	$(BIN)/python bench/bench_dra_sharing.py --control-plane-only
	$(BIN)/python bench/bench_dra_vs_go.py --foreign 10000
else
	@echo "bench/bench_dra_sharing.py and bench_dra_vs_go.py skipped: they need root (the e2e cluster's control plane)"
endif

## Regenerate kxpu/api from its .proto files (committed; `lint` checks they are current).
proto: dev
	$(BIN)/python hack/genproto.py

## The real single-node cluster (kubelet, API server, scheduler, controller-manager, etcd, containerd),
## built from upstream Go modules into /var/cache/kxpu once (~15 min: containerd, Kubernetes 1.37 and 1.34), then the e2e scenarios. Root only.
cluster-build:
	hack/cluster/build.sh all
	KXPU_K8S_RELEASE=$(OLDEST_K8S) hack/cluster/build.sh k8s

cluster-up: dev cluster-build
	$(BIN)/python -m e2e.cluster up

cluster-down: dev
	$(BIN)/python -m e2e.cluster down

## Every scenario on the newest Kubernetes release, then the device-plugin core (-m core) on the oldest supported.
e2e: dev helm
ifeq ($(ROOT),0)
	hack/cluster/build.sh all
	KXPU_K8S_RELEASE=$(OLDEST_K8S) hack/cluster/build.sh k8s
	hack/image/build.sh
	$(BIN)/pytest tests/test_image_bytecode.py -q
	$(BIN)/pytest e2e -q
	KXPU_K8S_RELEASE=$(OLDEST_K8S) $(BIN)/pytest e2e -q -m core
else
	@echo "e2e: SKIPPED — the kubelet and containerd need root (cgroups, mounts, network namespaces)"
endif

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

## The chart packaged for a registry (out/kxpu-<version>.tgz; `helm push` it to an oci:// repository).
chart: helm
	hack/helm/package.sh

## Re-pin the image's Python dependencies after pyproject.toml changes.
image-lock: dev
	$(BIN)/python hack/image/lock.py

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache *.egg-info
