#!/usr/bin/env bash
# Builds NVIDIA's device plugin (github.com/NVIDIA/k8s-device-plugin, pinned in ./go.mod) from its Go module into
#   ${KXPU_CACHE:-/var/cache/kxpu}/nvidia-device-plugin-<version>/bin/nvidia-device-plugin
# for bench/bench_nvidia_vs_go.py (hack/go-module-build.sh). Prints the binary's path.
# cgo is needed (go-nvml's bindings), but no driver: libnvidia-ml.so.1 is dlopened when the plugin starts.
# The binary needs glibc 2.34 or newer where it runs.
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
CGO_ENABLED=1 exec "$HERE/../go-module-build.sh" "$HERE" nvidia-device-plugin github.com/NVIDIA/k8s-device-plugin \
  github.com/NVIDIA/k8s-device-plugin/cmd/nvidia-device-plugin --version \
  "-X github.com/NVIDIA/k8s-device-plugin/internal/info.version=%VERSION%"
