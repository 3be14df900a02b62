#!/usr/bin/env bash
# Builds the kxpu image without a container engine or registry: the same image the Dockerfile describes
# (Debian bookworm, Debian's python3, a venv at /opt/kxpu with the pinned wheels and kxpu, user 65532),
# from the Debian mirror and PyPI only, written as an OCI archive that `ctr -n k8s.io images import`,
# `skopeo copy oci-archive:...` and `podman load` read.
#
#   layer 1  Debian bookworm minbase + python3, slimmed like debian:bookworm-slim   (mmdebstrap)
#   layer 2  /opt/kxpu: the venv with hack/image/requirements.txt and the kxpu wheel (pip in a chroot)
#
# Caches, each keyed by a digest of its inputs and used only when complete (a .partial is never used):
#   ${KXPU_CACHE:-/var/cache/kxpu}/image/base-<key>/   OCI layout holding layer 1 (key: this script)
#   out/kxpu-image.tar + out/kxpu-image.tar.key        the image (key: base, this script, the lock files,
#                                                      kxpu's sources, the reference, SOURCE_DATE_EPOCH)
#
# usage: hack/image/build.sh            build (or reuse) out/kxpu-image.tar; prints its path
#        hack/image/build.sh ref        print the image reference
# env:   KXPU_IMAGE_REF (default localhost/kxpu:<version from pyproject.toml>), KXPU_IMAGE_OUT,
#        SOURCE_DATE_EPOCH (the image's "created" time; default: the last commit that touched kxpu's sources,
#        so unrelated commits reuse the cached image)
# needs: root (installs mmdebstrap and umoci with apt-get if missing), python3 >= 3.11.
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(cd "$HERE/../.." && pwd)
CACHE=${KXPU_CACHE:-/var/cache/kxpu}/image
OUT=${KXPU_IMAGE_OUT:-$REPO/out/kxpu-image.tar}
VERSION=$(python3 -c 'import sys, tomllib; print(tomllib.load(open(sys.argv[1], "rb"))["project"]["version"])' \
  "$REPO/pyproject.toml")
REF=${KXPU_IMAGE_REF:-localhost/kxpu:$VERSION}
SOURCES=(kxpu pyproject.toml README.md)  # what the kxpu wheel is built from
export SOURCE_DATE_EPOCH=${SOURCE_DATE_EPOCH:-$(git -C "$REPO" log -1 --format=%ct -- "${SOURCES[@]}" 2>/dev/null || echo 0)}

SUITE=bookworm
MIRRORS=(
  "deb http://deb.debian.org/debian $SUITE main"
  "deb http://deb.debian.org/debian $SUITE-updates main"
  "deb http://deb.debian.org/debian-security $SUITE-security main"
)
UID_GID=65532:65532  # the image's default user; the node daemon's pod overrides it with root
VENV=/opt/kxpu
# Needs pip (for `pip wheel` and `pip download`): the project venv if there is one.
PY=$REPO/.venv/bin/python; [[ -x $PY ]] || PY=python3

log() { printf '%s image: %s\n' "$(date +%H:%M:%S)" "$*" >&2; }
# Removes build directories without ever following a mount a killed build left inside them (mmdebstrap binds
# the host's /dev, /proc and /sys into its chroot; this script mounts /proc).
safe_rm() {
  local dir
  for dir in "$@"; do
    [[ -e $dir ]] || continue
    awk -v d="$(realpath "$dir")/" 'index($5 "/", d) == 1 {print $5}' /proc/self/mountinfo | sort -r |
      while read -r m; do umount -l "$m"; done
    rm -rf --one-file-system "$dir"
  done
}
digest() { sha256sum | cut -d' ' -f1; }

case ${1:-build} in
  ref) echo "$REF"; exit 0 ;;
  build) ;;
  *) echo "usage: $0 [build|ref]" >&2; exit 2 ;;
esac
((EUID == 0)) || { log "needs root (mmdebstrap and chroot)"; exit 1; }
missing=()
for tool in mmdebstrap umoci; do command -v "$tool" >/dev/null || missing+=("$tool"); done
if ((${#missing[@]})); then
  # A fresh machine (CI) has neither: install them, as the cluster build does its packages.
  log "apt-get install ${missing[*]}"
  DEBIAN_FRONTEND=noninteractive apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >&2
fi
"$PY" "$HERE/lock.py" --check

mkdir -p "$CACHE"
exec 9>"$CACHE/.image-build.lock"  # one build at a time per cache (the base layer and apt archives are shared)
flock 9

BASE_KEY=$(digest <"$HERE/build.sh")
BASE=$CACHE/base-$BASE_KEY
# kxpu's sources as git sees them (tracked and new files, not ignored ones), by content.
src_digest() {
  (cd "$REPO" && git ls-files -co --exclude-standard --deduplicate -- "${SOURCES[@]}" |
    LC_ALL=C sort | while read -r f; do if [[ -f $f ]]; then sha256sum "$f"; fi; done) | digest
}
APP_KEY=$({ echo "$BASE_KEY $REF $SOURCE_DATE_EPOCH"; cat "$HERE/requirements.txt" "$HERE/installer.txt"; src_digest; } |
  digest)

if [[ -f $OUT && -f $OUT.key && "$(cat "$OUT.key")" == "$APP_KEY" ]]; then
  log "cached: $OUT ($REF)"
  echo "$OUT"
  exit 0
fi

t_start=$SECONDS
WORK=$(mktemp -d "${TMPDIR:-/tmp}/kxpu-image.XXXXXX")
trap 'safe_rm "$WORK"' EXIT

# -- layer 1: Debian + python3 ------------------------------------------------------------------------------
build_base() {
  local tmp=$BASE.partial t0=$SECONDS
  safe_rm "$tmp"; mkdir -p "$tmp" "$CACHE/apt-archives"
  umoci init --layout "$tmp/oci"
  umoci new --image "$tmp/oci:base"
  umoci unpack --image "$tmp/oci:base" "$tmp/bundle"
  log "base: mmdebstrap $SUITE minbase + python3"
  # The dpkg excludes are debian:bookworm-slim's (docs, man pages, translations; copyright files stay).
  # Downloaded .debs are kept in the cache between base builds; apt lists and logs do not reach the image.
  # shellcheck disable=SC2016  # the hooks' "$1" is the chroot, expanded by mmdebstrap's shell
  # merged-usr hook: the /usr symlinks without the usrmerge package, which would pull in perl (50 MB).
  nice -n 10 mmdebstrap --mode=root --variant=minbase --format=directory \
    --hook-dir=/usr/share/mmdebstrap/hooks/merged-usr \
    --aptopt='APT::Install-Recommends "false"' --aptopt='Acquire::Languages "none"' \
    --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-include=/usr/share/doc/*/copyright' \
    --dpkgopt='path-exclude=/usr/share/man/*' --dpkgopt='path-exclude=/usr/share/info/*' \
    --dpkgopt='path-exclude=/usr/share/locale/*' --dpkgopt='path-exclude=/usr/share/groff/*' \
    --dpkgopt='path-exclude=/usr/share/lintian/*' --dpkgopt='path-exclude=/usr/share/linda/*' \
    --include=python3 \
    --setup-hook='mkdir -p "$1/var/cache/apt/archives"' \
    --setup-hook="sync-in $CACHE/apt-archives /var/cache/apt/archives" \
    --customize-hook="sync-out /var/cache/apt/archives $CACHE/apt-archives" \
    --customize-hook='echo "kxpu:x:65532:65532:kxpu:/nonexistent:/usr/sbin/nologin" >>"$1/etc/passwd"' \
    --customize-hook='echo "kxpu:x:65532:" >>"$1/etc/group"' \
    --customize-hook='rm -rf "$1"/var/cache/apt/* "$1"/var/lib/apt/lists/* "$1"/var/log/* "$1"/var/cache/debconf/*-old "$1"/var/lib/dpkg/*-old' \
    "$SUITE" "$tmp/bundle/rootfs" "${MIRRORS[@]}"
  # The runtime provides /dev; device nodes made for the install do not belong in a layer.
  find "$tmp/bundle/rootfs/dev" -mindepth 1 -delete
  umoci repack --image "$tmp/oci:base" --history.created_by "mmdebstrap $SUITE minbase + python3 (hack/image/build.sh)" \
    --history.created "$(date -u -d "@$SOURCE_DATE_EPOCH" +%Y-%m-%dT%H:%M:%SZ)" "$tmp/bundle"
  safe_rm "$tmp/bundle"
  umoci gc --layout "$tmp/oci"
  log "base: built in $((SECONDS - t0))s"
  echo "$BASE_KEY" >"$tmp/.stamp"
  safe_rm "$BASE"; mv "$tmp" "$BASE"
  # Older bases are superseded (this script changed); keep the cache to one.
  local old
  for old in "$CACHE"/base-*; do
    [[ $old == "$BASE" || $old == *.partial ]] || safe_rm "$old"
  done
}
if [[ -f $BASE/.stamp ]]; then log "base: cached in $BASE"; else build_base; fi

# -- layer 2: the venv --------------------------------------------------------------------------------------
t0=$SECONDS
log "app: kxpu wheel and pinned dependencies"
mkdir -p "$WORK/wheels"
# The kxpu wheel, built from the working tree, and the pinned wheels for the image's interpreter (not this
# machine's), checked against the lock's hashes.
(cd "$REPO" && "$PY" -m pip wheel --quiet --no-deps --no-cache-dir --wheel-dir "$WORK/wheels" .) >&2
"$PY" "$HERE/lock.py" --download "$WORK/wheels" --arch "$(uname -m)" >&2
cp "$HERE/requirements.txt" "$WORK/wheels/"

cp -a "$BASE/oci" "$WORK/oci"
umoci unpack --image "$WORK/oci:base" "$WORK/bundle"
ROOT=$WORK/bundle/rootfs
mkdir -p "$ROOT/tmp/wheels"
cp "$WORK"/wheels/* "$ROOT/tmp/wheels/"
pip_whl=$(cd "$ROOT/tmp/wheels" && ls pip-*.whl)
kxpu_whl=$(cd "$ROOT/tmp/wheels" && ls kxpu-*.whl)
# The chroot gets /proc and the few device nodes Python may open; none of them reach the layer.
mount -t proc proc "$ROOT/proc"
while read -r name major minor; do
  mknod -m 666 "$ROOT/dev/$name" c "$major" "$minor"
done <<<$'null 1 3\nzero 1 5\nrandom 1 8\nurandom 1 9'
in_root() {  # [--user UID:GID] CMD...: run in the image's root with a clean environment
  local spec=()
  if [[ $1 == --user ]]; then spec=(--userspec="$2"); shift 2; fi
  nice -n 10 chroot "${spec[@]}" "$ROOT" /usr/bin/env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin LANG=C.UTF-8 "$@"
}
# A venv without pip; pip runs from its wheel file (as get-pip does), so it is not left in the image.
in_root python3 -m venv --without-pip "$VENV"
pip_in_root() {
  in_root "$VENV/bin/python" "/tmp/wheels/$pip_whl/pip" --disable-pip-version-check --no-cache-dir \
    --no-input "$@"
}
pip_in_root install --quiet --no-index --find-links /tmp/wheels --require-hashes -r /tmp/wheels/requirements.txt
pip_in_root install --quiet --no-index --no-deps "/tmp/wheels/$kxpu_whl"
# A stale lock (a dependency kxpu needs but the lock lacks) fails here, not on a node.
pip_in_root check >&2
# Bytecode that stays valid: pip's .pyc files record their source's mtime, which the layer's tar rounds to the
# second, so most no longer matched and every start compiled those modules again (the venv is read-only to the
# daemon, PYTHONDONTWRITEBYTECODE): 600 of 980 modules, 40 % of the start. Unchecked-hash .pyc never look at the
# source (the image's files never change).
in_root "$VENV/bin/python" -m compileall -q -f --invalidation-mode unchecked-hash "$VENV/lib" >&2
# Smoke test as the image's user: the entry point runs and a built-in backend discovers devices.
in_root --user "$UID_GID" "$VENV/bin/kxpu" --version >&2
printf 'version: v1\nresources:\n  - name: example.com/smoke\n    simulated: {count: 2}\n' >"$ROOT/tmp/smoke.yaml"
in_root --user "$UID_GID" "$VENV/bin/kxpu" devices --config /tmp/smoke.yaml >&2
umount "$ROOT/proc"
rm -f "$ROOT"/dev/{null,zero,random,urandom}
rm -rf "$ROOT/root/.cache"
find "$ROOT/tmp" -mindepth 1 -delete

created=$(date -u -d "@$SOURCE_DATE_EPOCH" +%Y-%m-%dT%H:%M:%SZ)
TAG=kxpu
umoci repack --image "$WORK/oci:$TAG" --history.created "$created" \
  --history.created_by "venv $VENV: hack/image/requirements.txt + kxpu $VERSION (hack/image/build.sh)" "$WORK/bundle"
safe_rm "$WORK/bundle"
umoci config --image "$WORK/oci:$TAG" --no-history --created "$created" --author "kxpu" \
  --config.user "$UID_GID" --config.workingdir / \
  --config.entrypoint "$VENV/bin/kxpu" --config.cmd=--help \
  --config.env "PATH=$VENV/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin" \
  --config.env LANG=C.UTF-8 --config.env PYTHONUNBUFFERED=1 --config.env PYTHONDONTWRITEBYTECODE=1 \
  --config.label "org.opencontainers.image.title=kxpu" \
  --config.label "org.opencontainers.image.description=kxpu: heterogeneous accelerators on Kubernetes" \
  --config.label "org.opencontainers.image.version=$VERSION" \
  --config.label "org.opencontainers.image.licenses=Apache-2.0" \
  --config.label "org.opencontainers.image.base.name=debian:$SUITE (mmdebstrap minbase)"
umoci rm --image "$WORK/oci:base"
umoci gc --layout "$WORK/oci"

# Name the image by its full reference: containerd takes io.containerd.image.name, OCI tools ref.name.
python3 - "$WORK/oci/index.json" "$REF" <<'EOF'
import json, sys
path, ref = sys.argv[1:]
index = json.load(open(path))
(manifest,) = index["manifests"]
manifest["annotations"] = {"io.containerd.image.name": ref, "org.opencontainers.image.ref.name": ref}
json.dump(index, open(path, "w"), separators=(",", ":"))
EOF
mkdir -p "$(dirname "$OUT")"
tar --sort=name --mtime="@$SOURCE_DATE_EPOCH" --owner=0 --group=0 --numeric-owner \
  -cf "$OUT.partial" -C "$WORK/oci" oci-layout index.json blobs
mv "$OUT.partial" "$OUT"
echo "$APP_KEY" >"$OUT.key"
size=$(du -m "$OUT" | cut -f1)
log "app: built in $((SECONDS - t0))s; total $((SECONDS - t_start))s"
log "wrote $OUT ($REF, ${size} MiB compressed)"
echo "$OUT"
