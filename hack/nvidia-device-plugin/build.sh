#!/usr/bin/env bash
# Builds NVIDIA's device plugin (github.com/NVIDIA/k8s-device-plugin, pinned in ./go.mod) from its Go module into
#   ${KXPU_CACHE:-/var/cache/kxpu}/nvidia-device-plugin-<version>/bin/nvidia-device-plugin
# for bench/bench_nvidia_vs_go.py. Neither its code nor the binary is committed. Prints the binary's path.
# cgo is needed (go-nvml's bindings), but no driver: libnvidia-ml.so.1 is dlopened when the plugin starts.
# The binary needs glibc 2.34 or newer where it runs. An entry is reused while its .stamp (module files,
# flags, toolchain) matches.
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
CACHE=${KXPU_CACHE:-/var/cache/kxpu}
export CGO_ENABLED=1 GOTOOLCHAIN=local GOFLAGS="-trimpath -buildvcs=false -mod=readonly"
VERSION=$(awk '$1 == "require" && $2 == "github.com/NVIDIA/k8s-device-plugin" {print $3}' "$HERE/go.mod")
DIR=$CACHE/nvidia-device-plugin-$VERSION
BIN=$DIR/bin/nvidia-device-plugin
STAMP=$( { cat "$HERE/go.mod" "$HERE/go.sum"; echo "$GOFLAGS $CGO_ENABLED"; go env GOVERSION CC; } | sha256sum | cut -d' ' -f1)

mkdir -p "$CACHE"
exec 9>"$CACHE/.nvidia-device-plugin-build.lock"
flock 9
if [[ ! -x $BIN || ! -f $DIR/.stamp || "$(cat "$DIR/.stamp")" != "$STAMP" ]]; then
  printf '%s nvidia-device-plugin %s: building\n' "$(date +%H:%M:%S)" "$VERSION" >&2
  rm -rf "$DIR"
  mkdir -p "$DIR/bin"
  (cd "$HERE" && nice -n 10 go build -o "$DIR/bin/" -ldflags="-s -w -X github.com/NVIDIA/k8s-device-plugin/internal/info.version=$VERSION" \
    github.com/NVIDIA/k8s-device-plugin/cmd/nvidia-device-plugin)
  "$BIN" --version >/dev/null
  echo "$STAMP" >"$DIR/.stamp"
fi
echo "$BIN"
