#!/usr/bin/env bash
# Builds one command of a Go module pinned in a peer's go.mod (hack/<peer>/) into
#   ${KXPU_CACHE:-/var/cache/kxpu}/NAME-<version>/bin/<the command's last path element>
# and prints the binary's path; neither the module's code nor the binary is committed. An entry is reused while its
# .stamp (module files, flags, toolchain, and the C compiler when cgo is on) matches; builds of one NAME take turns.
# Usage, from hack/<peer>/build.sh:
#   hack/go-module-build.sh DIR NAME MODULE COMMAND CHECK_ARG [LDFLAGS]
# DIR holds go.mod/go.sum; CHECK_ARG is run as "<binary> CHECK_ARG" to check the build; %VERSION% in LDFLAGS is the
# module's version. CGO_ENABLED from the environment (0 when unset).
set -euo pipefail

DIR_MOD=$1 NAME=$2 MODULE=$3 COMMAND=$4 CHECK=$5 LDFLAGS=${6:-}
CACHE=${KXPU_CACHE:-/var/cache/kxpu}
export CGO_ENABLED=${CGO_ENABLED:-0} GOTOOLCHAIN=local GOFLAGS="-trimpath -buildvcs=false -mod=readonly"
VERSION=$(awk -v m="$MODULE" '$1 == "require" && $2 == m {print $3}' "$DIR_MOD/go.mod")
DIR=$CACHE/$NAME-$VERSION
BIN=$DIR/bin/${COMMAND##*/}
TOOLCHAIN=(GOVERSION)
[[ $CGO_ENABLED == 1 ]] && TOOLCHAIN+=(CC)
STAMP=$( { cat "$DIR_MOD/go.mod" "$DIR_MOD/go.sum"; echo "$GOFLAGS $CGO_ENABLED"; go env "${TOOLCHAIN[@]}"; } | sha256sum | cut -d' ' -f1)

mkdir -p "$CACHE"
exec 9>"$CACHE/.$NAME-build.lock"
flock 9
if [[ ! -x $BIN || ! -f $DIR/.stamp || "$(cat "$DIR/.stamp")" != "$STAMP" ]]; then
  printf '%s %s %s: building\n' "$(date +%H:%M:%S)" "$NAME" "$VERSION" >&2
  rm -rf "$DIR"
  mkdir -p "$DIR/bin"
  (cd "$DIR_MOD" && nice -n 10 go build -o "$DIR/bin/" -ldflags="-s -w ${LDFLAGS//%VERSION%/$VERSION}" "$COMMAND")
  "$BIN" "$CHECK" >/dev/null
  echo "$STAMP" >"$DIR/.stamp"
fi
echo "$BIN"
