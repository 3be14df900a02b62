#!/usr/bin/env bash
# Runs pytest on the newest CPython kxpu supports (`make unit-newest`): Debian trixie's python3 (3.13) in a
# chroot built with mmdebstrap, so that CI tests the oldest supported Python (the machine's 3.11) and the newest
# from the same clone, with nothing but Debian's packages and PyPI (no interpreter downloads from elsewhere).
#
#   hack/newest-python.sh [pytest arguments]     e.g. hack/newest-python.sh tests/test_resource_runner.py
#
# The chroot and its venv (kxpu's dependencies, not kxpu: the checkout is bind-mounted at /src and imported
# from there) are cached in $KXPU_CACHE/python-newest, keyed by this script and pyproject.toml:
# about a minute to build cold, nothing when cached. The checkout is mounted in a private mount namespace that
# goes away with the run, so nothing is left mounted. Needs root (mmdebstrap, unshare, chroot).
set -euo pipefail

REPO=$(cd "$(dirname "$0")/.." && pwd)
CACHE=${KXPU_CACHE:-/var/cache/kxpu}/python-newest
SUITE=trixie
MIRROR="deb http://deb.debian.org/debian $SUITE main"
ROOT=$CACHE/rootfs
VENV=/opt/kxpu-venv

log() { printf '%s newest-python: %s\n' "$(date +%H:%M:%S)" "$*" >&2; }

((EUID == 0)) || { log "needs root (mmdebstrap, unshare and chroot)"; exit 1; }
if ! command -v mmdebstrap >/dev/null; then  # a fresh machine (CI): installed as hack/image/build.sh does
  log "apt-get install mmdebstrap"
  DEBIAN_FRONTEND=noninteractive apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends mmdebstrap >&2
fi

mkdir -p "$CACHE"
exec 9>"$CACHE/.lock"
flock 9  # one build at a time, and never while a run uses the chroot (each run in its own mount namespace)

KEY=$(cat "$0" "$REPO/pyproject.toml" | sha256sum | cut -c1-16)
if [[ "$(cat "$ROOT/.stamp" 2>/dev/null)" != "$KEY" ]]; then
  t0=$SECONDS
  log "building the $SUITE chroot with python3 and kxpu's dependencies in $ROOT"
  rm -rf --one-file-system "$ROOT.partial" "$ROOT"
  nice -n 10 mmdebstrap --mode=root --variant=minbase --format=directory --quiet \
    --hook-dir=/usr/share/mmdebstrap/hooks/merged-usr \
    --aptopt='APT::Install-Recommends "false"' --aptopt='Acquire::Languages "none"' \
    --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-exclude=/usr/share/man/*' \
    --dpkgopt='path-exclude=/usr/share/locale/*' \
    --include=python3,python3-venv \
    --customize-hook='rm -rf "$1"/var/cache/apt/* "$1"/var/lib/apt/lists/*' \
    "$SUITE" "$ROOT.partial" "$MIRROR" >/dev/null  # dpkg's progress; errors go to stderr
  # kxpu's dependencies and what its tests need (not its linters), as pyproject.toml lists them: downloaded by
  # the host's pip, with the host's index and CA settings (Python 3.13's strict certificate checks refuse some
  # proxies' CAs), as wheels for the chroot's CPython and glibc, then installed there offline. kxpu itself is
  # imported from the checkout at /src.
  PY=$REPO/.venv/bin/python; [[ -x $PY ]] || PY=python3
  wheels=$ROOT.partial/tmp/wheels
  mkdir -p "$wheels"
  "$PY" -c '
import re, sys, tomllib
project = tomllib.load(open(sys.argv[1], "rb"))["project"]
linters = re.compile(r"(mypy|mypy-protobuf|ruff|grpcio-tools|grpc-stubs|types-.*)")
tests = [r for r in project["optional-dependencies"]["dev"] if not linters.fullmatch(re.split(r"[<>=!~\[; ]", r)[0])]
print("\n".join(project["dependencies"] + tests))
' "$REPO/pyproject.toml" >"$wheels/requirements.txt"
  glibc=$(chroot "$ROOT.partial" python3 -c 'import os; print(os.confstr("CS_GNU_LIBC_VERSION").split(".")[1])')
  pyver=$(chroot "$ROOT.partial" python3 -c 'import sys; print("%d.%d" % sys.version_info[:2])')
  platforms=()
  for ((minor = glibc; minor >= 5; minor--)); do platforms+=(--platform "manylinux_2_${minor}_x86_64"); done
  "$PY" -m pip download --quiet --disable-pip-version-check --only-binary=:all: \
    "${platforms[@]}" --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
    --python-version "$pyver" --implementation cp --abi "cp${pyver/./}" \
    --dest "$wheels" -r "$wheels/requirements.txt"
  chroot "$ROOT.partial" env -u PIP_FIND_LINKS sh -euc "
    python3 -m venv $VENV
    $VENV/bin/python -m pip install --quiet --disable-pip-version-check --no-index --find-links /tmp/wheels \
      -r /tmp/wheels/requirements.txt
    rm -rf /tmp/wheels
    mkdir -p /src"
  echo "$KEY" >"$ROOT.partial/.stamp"
  mv "$ROOT.partial" "$ROOT"
  log "built in $((SECONDS - t0))s"
fi
flock -s 9  # held by the run (the fd goes with exec): runs share the chroot, a rebuild waits for them

log "$(chroot "$ROOT" $VENV/bin/python -V) on $SUITE: pytest $*"
# A private mount namespace: the checkout, /proc and a fresh /dev/shm are mounted for this run only.
# PYTHONDONTWRITEBYTECODE and no pytest cache: the checkout stays as it was (the 3.11 venv's caches untouched).
exec unshare --mount --propagation private -- sh -euc '
  root=$1 repo=$2 venv=$3; shift 3
  mount --bind "$repo" "$root/src"
  mount -t proc proc "$root/proc"
  mount -t tmpfs -o mode=1777 tmpfs "$root/dev/shm"
  mount -t tmpfs -o mode=1777 tmpfs "$root/tmp"
  exec chroot "$root" env -i PATH="$venv/bin:/usr/bin:/bin" HOME=/root LANG=C.UTF-8 PYTHONPATH=/src \
    PYTHONDONTWRITEBYTECODE=1 sh -c "cd /src && exec python -m pytest -p no:cacheprovider \"\$@\"" pytest "$@"
' newest-python "$ROOT" "$REPO" "$VENV" "$@"
