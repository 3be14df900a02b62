#!/usr/bin/env bash
# Builds helm from its Go module into a cache keyed by version (there is no release download here, only the Go
# module proxy):
#   ${KXPU_CACHE:-/var/cache/kxpu}/helm-<version>/helm
# An entry is used only when its .stamp (written last, after the binary answered `helm version`) matches the
# version, build flags and Go toolchain; a partial build lives in helm-<version>.partial and is never used.
#
# usage: hack/helm/build.sh [build|path]   (default: build; prints the binary's path on stdout either way)
#   HELM_VERSION=v3.x.y overrides the pinned version.
set -euo pipefail

HELM_VERSION=${HELM_VERSION:-v3.22.0}
CACHE=${KXPU_CACHE:-/var/cache/kxpu}
DIR=$CACHE/helm-$HELM_VERSION
MODULE=helm.sh/helm/v${HELM_VERSION:1:1}
export CGO_ENABLED=0 GOTOOLCHAIN=local GOFLAGS="-trimpath -buildvcs=false"

log() { printf '%s helm: %s\n' "$(date +%H:%M:%S)" "$*" >&2; }

if [[ ${1:-build} == path ]]; then echo "$DIR/helm"; exit 0; fi
[[ ${1:-build} == build ]] || { echo "usage: $0 [build|path]" >&2; exit 2; }
mkdir -p "$CACHE"
exec 9>"$CACHE/.helm-build.lock"  # one build at a time per cache
flock 9

# helm's Makefile stamps its version and the Kubernetes version it assumes when no cluster is asked
# (`helm template`, `helm lint`: .Capabilities.KubeVersion); both come from -X flags, so set them the same way.
# The Kubernetes version is that of the client-go it is built with, with the major shifted (v0.34 -> v1.34).
gomod=$(cd / && go mod download -json "$MODULE@$HELM_VERSION" | sed -n 's/^\s*"GoMod": "\(.*\)",$/\1/p')
[[ -f $gomod ]] || { log "FAILED: cannot download $MODULE@$HELM_VERSION from the Go module proxy"; exit 1; }
client_go=$(awk '$1 == "k8s.io/client-go" {print $2; exit}' "$gomod")
k8s_minor=$(cut -d. -f2 <<<"$client_go")
ldflags="-s -w -X $MODULE/internal/version.version=$HELM_VERSION -X $MODULE/internal/version.gitTreeState=clean"
for pkg in pkg/lint/rules pkg/chartutil; do
  ldflags+=" -X $MODULE/$pkg.k8sVersionMajor=1 -X $MODULE/$pkg.k8sVersionMinor=$k8s_minor"
done
stamp=$({ echo "$HELM_VERSION $GOFLAGS $CGO_ENABLED $ldflags"; go env GOVERSION; } | sha256sum | cut -d' ' -f1)

if [[ -x $DIR/helm && -f $DIR/.stamp && "$(cat "$DIR/.stamp")" == "$stamp" ]]; then
  log "$HELM_VERSION: cached in $DIR"
  echo "$DIR/helm"
  exit 0
fi

tmp=$DIR.partial
rm -rf "$DIR" "$tmp"
mkdir -p "$tmp"
log "$HELM_VERSION: building $MODULE/cmd/helm (client-go $client_go)"
t0=$SECONDS
# `go install pkg@version` builds with helm's own go.mod and go.sum (checked against the checksum database).
(cd / && GOBIN=$tmp nice -n 10 go install -ldflags="$ldflags" "$MODULE/cmd/helm@$HELM_VERSION")
log "$HELM_VERSION: built in $((SECONDS - t0))s"
if ! out=$("$tmp/helm" version --short 2>&1) || [[ $out != "$HELM_VERSION"* ]]; then
  log "FAILED: the built helm says: $out"
  exit 1
fi
log "ok: helm version $out"
echo "$stamp" >"$tmp/.stamp"
mv "$tmp" "$DIR"
echo "$DIR/helm"
