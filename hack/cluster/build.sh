#!/usr/bin/env bash
# Builds the pinned upstream binaries of the kxpu e2e cluster into a cache keyed by version:
#   ${KXPU_CACHE:-/var/cache/kxpu}/k8s-<version>/bin/{kubelet,kube-apiserver,kube-scheduler,
#       kube-controller-manager,kubectl,etcd,pause}
#   ${KXPU_CACHE:-/var/cache/kxpu}/containerd-<version>/bin/{containerd,containerd-shim-runc-v2,ctr}
# and installs runc and the CNI plugins from Debian. An entry is used only when its .stamp (written last, after
# every binary answered --version) matches the module files; anything else is rebuilt from scratch.
#
# Each tested Kubernetes release has its own module, k8s/<release>/go.mod; KXPU_K8S_RELEASE (e.g. 1.34) picks
# one, default the newest. `releases` lists them, newest first.
#
# usage: hack/cluster/build.sh [deps|k8s|containerd|all|paths|releases]   (default: all; needs root for deps)
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
CACHE=${KXPU_CACHE:-/var/cache/kxpu}
RELEASES=$(cd "$HERE/k8s" && ls -d [0-9]* | sort -rV)
RELEASE=${KXPU_K8S_RELEASE:-$(head -n1 <<<"$RELEASES")}
K8S_MOD=$HERE/k8s/$RELEASE
if [[ ! -f $K8S_MOD/go.mod ]]; then
  echo "KXPU_K8S_RELEASE=$RELEASE: no such release; tested: $(tr '\n' ' ' <<<"$RELEASES")" >&2
  exit 2
fi
export CGO_ENABLED=0 GOTOOLCHAIN=local GOFLAGS="-trimpath -buildvcs=false -mod=readonly"

log() { printf '%s build: %s\n' "$(date +%H:%M:%S)" "$*" >&2; }

# One build at a time per cache (two checkouts, or CI beside a developer): each waits for the other.
if [[ ${1:-all} != paths && ${1:-all} != releases ]]; then
  mkdir -p "$CACHE"
  exec 9>"$CACHE/.cluster-build.lock"
  flock 9
fi

# The version a go.mod requires for a module (first match of "<module> vX").
mod_version() {
  awk -v m="$2" '$1 == "require" {$1 = ""; $0 = $0} $1 == m && $2 ~ /^v/ {print $2; exit}' "$1/go.mod"
}

K8S_VERSION=$(mod_version "$K8S_MOD" k8s.io/kubernetes)
CTRD_VERSION=$(mod_version "$HERE/containerd" github.com/containerd/containerd)
K8S_DIR=$CACHE/k8s-$K8S_VERSION
CTRD_DIR=$CACHE/containerd-$CTRD_VERSION

# What a cache entry was built from: module files, build flags and toolchain. A mismatch means rebuild.
stamp_for() {
  { cat "$1/go.mod" "$1/go.sum"; echo "$GOFLAGS $CGO_ENABLED $2"; go env GOVERSION; } | sha256sum | cut -d' ' -f1
}

fresh() { [[ -f $1/.stamp && "$(cat "$1/.stamp")" == "$2" ]]; }

# Runs each binary's version command; a binary that cannot say its version is a broken build.
verify() {
  local bin=$1; shift
  local out
  if ! out=$("$@" 2>&1); then
    log "FAILED: $bin does not run: $out"; return 1
  fi
  log "ok: $(basename "$bin"): $(head -n1 <<<"$out")"
}

build_k8s() {
  local minor=${K8S_VERSION#v1.}; minor=${minor%%.*}
  local ldflags="-s -w"
  local pkg
  for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
    ldflags+=" -X $pkg.gitVersion=$K8S_VERSION -X $pkg.gitMajor=1 -X $pkg.gitMinor=$minor"
    ldflags+=" -X $pkg.gitTreeState=clean -X $pkg.buildDate=1970-01-01T00:00:00Z"
  done
  local stamp; stamp=$(stamp_for "$K8S_MOD" "$ldflags")
  if fresh "$K8S_DIR" "$stamp"; then log "k8s $K8S_VERSION: cached in $K8S_DIR"; return; fi
  local tmp=$K8S_DIR.partial
  rm -rf "$K8S_DIR" "$tmp"; mkdir -p "$tmp/bin"
  log "k8s $K8S_VERSION: building (one go build so shared packages compile once)"
  local t0=$SECONDS
  (cd "$K8S_MOD" && nice -n 10 go build -o "$tmp/bin/" -ldflags="$ldflags" \
    k8s.io/kubernetes/cmd/kubelet k8s.io/kubernetes/cmd/kube-apiserver \
    k8s.io/kubernetes/cmd/kube-scheduler k8s.io/kubernetes/cmd/kube-controller-manager \
    k8s.io/kubernetes/cmd/kubectl go.etcd.io/etcd/server/v3)
  mv "$tmp/bin/server" "$tmp/bin/etcd"  # go names a .../server/v3 main package "server"
  (cd "$HERE/pause" && go build -o "$tmp/bin/pause" -ldflags="-s -w" .)
  log "k8s $K8S_VERSION: built in $((SECONDS - t0))s"
  local b
  for b in kubelet kube-apiserver kube-scheduler kube-controller-manager etcd; do
    verify "$b" "$tmp/bin/$b" --version
  done
  verify kubectl "$tmp/bin/kubectl" version --client
  [[ -x $tmp/bin/pause ]] || { log "FAILED: pause missing"; return 1; }
  echo "$stamp" >"$tmp/.stamp"
  mv "$tmp" "$K8S_DIR"
}

build_containerd() {
  local ldflags="-s -w -X github.com/containerd/containerd/version.Version=$CTRD_VERSION"
  ldflags+=" -X github.com/containerd/containerd/version.Package=github.com/containerd/containerd"
  local stamp; stamp=$(stamp_for "$HERE/containerd" "$ldflags")
  if fresh "$CTRD_DIR" "$stamp"; then log "containerd $CTRD_VERSION: cached in $CTRD_DIR"; return; fi
  local tmp=$CTRD_DIR.partial
  rm -rf "$CTRD_DIR" "$tmp"; mkdir -p "$tmp/bin"
  log "containerd $CTRD_VERSION: building"
  local t0=$SECONDS
  # Static build without cgo: the btrfs/devmapper/zfs snapshotters are not needed (overlayfs is used).
  (cd "$HERE/containerd" && nice -n 10 go build -o "$tmp/bin/" -ldflags="$ldflags" \
    -tags "no_btrfs no_devmapper no_zfs no_aufs" \
    github.com/containerd/containerd/cmd/containerd \
    github.com/containerd/containerd/cmd/containerd-shim-runc-v2 \
    github.com/containerd/containerd/cmd/ctr)
  log "containerd $CTRD_VERSION: built in $((SECONDS - t0))s"
  verify containerd "$tmp/bin/containerd" --version
  verify ctr "$tmp/bin/ctr" --version
  verify containerd-shim-runc-v2 "$tmp/bin/containerd-shim-runc-v2" -v
  echo "$stamp" >"$tmp/.stamp"
  mv "$tmp" "$CTRD_DIR"
}

install_deps() {
  local pkgs=(runc containernetworking-plugins busybox-static)
  local missing=() p
  for p in "${pkgs[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'ok installed' || missing+=("$p")
  done
  if ((${#missing[@]} == 0)); then log "debian packages present"; return; fi
  log "apt-get install ${missing[*]}"
  DEBIAN_FRONTEND=noninteractive apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >&2
}

case ${1:-all} in
  deps) install_deps ;;
  k8s) build_k8s ;;
  containerd) build_containerd ;;
  all) install_deps; build_containerd; build_k8s ;;
  paths) printf 'K8S_BIN=%s\nCONTAINERD_BIN=%s\nK8S_RELEASE=%s\nK8S_VERSION=%s\n' \
    "$K8S_DIR/bin" "$CTRD_DIR/bin" "$RELEASE" "$K8S_VERSION" ;;
  releases) echo "$RELEASES" ;;
  *) echo "usage: $0 [deps|k8s|containerd|all|paths|releases]" >&2; exit 2 ;;
esac
