#!/usr/bin/env bash
# Builds the Go DRA example driver (sigs.k8s.io/dra-example-driver, pinned in ./go.mod) from its Go module into
#   ${KXPU_CACHE:-/var/cache/kxpu}/dra-example-<version>/bin/dra-example-kubeletplugin
# for bench/bench_dra_vs_go.py (hack/go-module-build.sh). Prints the binary's path.
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
CGO_ENABLED=0 exec "$HERE/../go-module-build.sh" "$HERE" dra-example sigs.k8s.io/dra-example-driver \
  sigs.k8s.io/dra-example-driver/cmd/dra-example-kubeletplugin --help
