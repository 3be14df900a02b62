#!/usr/bin/env bash
# Makes what hack/gpu-startup-check.sh needs on a GPU machine without network, here (with the package registries):
#   DIR/whl/  kxpu's runtime dependencies, pinned as in hack/image/requirements.txt, as wheels for CPython
#             $KIT_PYTHON (3.12) on manylinux x86_64, and a pip wheel to install them with;
#   DIR/bin/nvidia-device-plugin   NVIDIA's device plugin from hack/nvidia-device-plugin/build.sh.
# Usage: hack/gpu-startup-kit.sh DIR. Then copy DIR/whl to <repo>/.whl and DIR/bin to <repo>/.gpu-bin (both
# ignored by git) and carry those two paths. Prints the kit's size (the device tool carries 64 MiB in all).
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
DIR=${1:?usage: hack/gpu-startup-kit.sh DIR}
KIT_PYTHON=${KIT_PYTHON:-3.12}
PIP=${PIP:-$HERE/../.venv/bin/pip}
mkdir -p "$DIR/whl" "$DIR/bin"
rm -f "$DIR"/whl/*.whl
platforms=()
for tag in manylinux1 manylinux2014 manylinux_2_17 manylinux_2_24 manylinux_2_27 manylinux_2_28 manylinux_2_31 \
  manylinux_2_34 manylinux_2_35; do
  platforms+=(--platform "${tag}_x86_64")
done
grep -E '^[A-Za-z0-9_.-]+==' "$HERE/image/requirements.txt" | sed 's/ *\\$//' >"$DIR/requirements.txt"
"$PIP" download -q --no-deps --only-binary=:all: --python-version "$KIT_PYTHON" --implementation cp \
  "${platforms[@]}" -d "$DIR/whl" -r "$DIR/requirements.txt" pip
cp "$("$HERE/nvidia-device-plugin/build.sh")" "$DIR/bin/nvidia-device-plugin"
du -sh "$DIR/whl" "$DIR/bin"
