#!/usr/bin/env bash
# Builds the Go DRA example driver (sigs.k8s.io/dra-example-driver, pinned in ./go.mod) from its Go module into
#   ${KXPU_CACHE:-/var/cache/kxpu}/dra-example-<version>/bin/dra-example-kubeletplugin
# for bench/bench_dra_vs_go.py. Neither its code nor the binary is committed. Prints the binary's path.
# An entry is reused while its .stamp (module files, flags, toolchain) matches.
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
CACHE=${KXPU_CACHE:-/var/cache/kxpu}
export CGO_ENABLED=0 GOTOOLCHAIN=local GOFLAGS="-trimpath -buildvcs=false -mod=readonly"
VERSION=$(awk '$1 == "require" && $2 == "sigs.k8s.io/dra-example-driver" {print $3}' "$HERE/go.mod")
DIR=$CACHE/dra-example-$VERSION
BIN=$DIR/bin/dra-example-kubeletplugin
STAMP=$( { cat "$HERE/go.mod" "$HERE/go.sum"; echo "$GOFLAGS $CGO_ENABLED"; go env GOVERSION; } | sha256sum | cut -d' ' -f1)

mkdir -p "$CACHE"
exec 9>"$CACHE/.dra-example-build.lock"
flock 9
if [[ ! -x $BIN || ! -f $DIR/.stamp || "$(cat "$DIR/.stamp")" != "$STAMP" ]]; then
  printf '%s dra-example %s: building\n' "$(date +%H:%M:%S)" "$VERSION" >&2
  rm -rf "$DIR"
  mkdir -p "$DIR/bin"
  (cd "$HERE" && nice -n 10 go build -o "$DIR/bin/" -ldflags="-s -w" \
    sigs.k8s.io/dra-example-driver/cmd/dra-example-kubeletplugin)
  "$BIN" --help >/dev/null
  echo "$STAMP" >"$DIR/.stamp"
fi
echo "$BIN"
