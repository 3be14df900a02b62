#!/usr/bin/env bash
# On a GPU machine without network: kxpu's NVIDIA backend side by side with NVIDIA's Go device plugin
# (bench/bench_nvidia_vs_go.py), everything bounded by KXPU_CHECK_SECONDS. Run from anywhere in the repo:
#   OUT=/some/dir hack/gpu-startup-check.sh [extra bench arguments]
# It needs, carried beside the tree (both ignored by git; the docs say how to make them):
#   .whl/       kxpu's runtime dependencies as CPython wheels for that machine's Python (pinned as in
#               hack/image/requirements.txt), and a pip wheel to install them with;
#   .gpu-bin/nvidia-device-plugin   from hack/nvidia-device-plugin/build.sh.
# Env: OUT (results; default ./out), PYTHON (python3), KXPU_WHEELS (.whl), KXPU_NVIDIA_DEVICE_PLUGIN
# (.gpu-bin/nvidia-device-plugin), KXPU_CHECK_SECONDS (270), KXPU_GPU_VENV (/tmp/kxpu-gpu-venv: made anew
# and left for what runs next, e.g. hack/gpu-check; where venv fails it holds site/ for PYTHONPATH instead),
# KXPU_BENCHES (which benches, in order; default "nvidia"):
#   nvidia    bench/bench_nvidia_vs_go.py with the extra arguments: $OUT/nvidia-vs-go.json (rewritten after
#             every run, so a run cut short still has its figures);
#   startup   bench/bench_startup.py --runs 7 --libs-floor on this machine's CPUs, no GPU needed: $OUT/startup.txt;
#   dra-cpu   bench/bench_dra_prepare_cpu.py --rounds 5 --files-floor: $OUT/dra-cpu.txt.
# The log is $OUT/gpu-startup-check.log.
set -uo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
OUT=${OUT:-$ROOT/out}
PYTHON=${PYTHON:-python3}
WHEELS=${KXPU_WHEELS:-$ROOT/.whl}
NVIDIA_BIN=${KXPU_NVIDIA_DEVICE_PLUGIN:-$ROOT/.gpu-bin/nvidia-device-plugin}
BUDGET=${KXPU_CHECK_SECONDS:-270}
END=$((SECONDS + BUDGET))
VENV=${KXPU_GPU_VENV:-/tmp/kxpu-gpu-venv}
if [[ -f $VENV/pyvenv.cfg || -d $VENV/site ]]; then
  rm -rf "$VENV"  # this script's from an earlier run
elif [[ -e $VENV ]]; then
  echo "gpu-startup-check: $VENV exists and is not an environment this script made: set KXPU_GPU_VENV" >&2
  exit 2
fi
mkdir -p "$OUT"
exec > >(tee -a "$OUT/gpu-startup-check.log") 2>&1

say() { printf '%s gpu-startup-check: %s\n' "$(date +%H:%M:%S)" "$*"; }
left() { echo $((END - SECONDS)); }

say "python: $(command -v "$PYTHON") $("$PYTHON" -V 2>&1); uid $(id -u); $(nproc) CPUs"
timeout 30 nvidia-smi --query-gpu=index,name,uuid,driver_version --format=csv,noheader 2>&1 | head -8
PIP=$(ls "$WHEELS"/pip-*.whl 2>/dev/null | head -1)
if [[ -z $PIP ]]; then
  say "no pip wheel in $WHEELS: copy /work/gpu-kit/whl there (see docs/nvidia.md)"
  exit 2
fi

# A venv of kxpu's dependencies alone (the torch environment's packages would slow its start); where venv
# cannot be made, the same wheels in a directory on PYTHONPATH.
if timeout 60 "$PYTHON" -m venv --without-pip "$VENV"; then
  PY=$VENV/bin/python
  timeout 120 "$PY" "$PIP/pip" install -q --no-index --no-deps --disable-pip-version-check --root-user-action=ignore "$WHEELS"/*.whl
else
  say "python -m venv failed: installing into $VENV/site instead"
  PY=$PYTHON
  timeout 120 "$PY" "$PIP/pip" install -q --no-index --no-deps --disable-pip-version-check --root-user-action=ignore \
    --target "$VENV/site" "$WHEELS"/*.whl
  export PYTHONPATH=$VENV/site
fi
status=$?
if ((status != 0)); then
  say "installing the wheels failed (status $status): are they for this Python ($("$PYTHON" -V 2>&1))?"
  exit 2
fi
# As the image and the dev install ship it: kxpu's bytecode compiled before its first start.
timeout 60 "$PY" -m compileall -q "$ROOT/kxpu" "$ROOT/bench" >/dev/null
say "installed in $((BUDGET - $(left))) s; $(left) s left"

export PYTHONUNBUFFERED=1
status=0
for bench in ${KXPU_BENCHES:-nvidia}; do
  say "$bench: $(left) s left"
  case $bench in
    nvidia)
      args=(--out "$OUT/nvidia-vs-go.json" --python "$PY")
      if [[ -f $NVIDIA_BIN ]]; then
        cp "$NVIDIA_BIN" "$VENV/nvidia-device-plugin" && chmod +x "$VENV/nvidia-device-plugin"
        args+=(--nvidia-bin "$VENV/nvidia-device-plugin")
      else
        say "no $NVIDIA_BIN: kxpu alone"
      fi
      timeout -k 10 "$(($(left) - 5))" "$PY" "$ROOT/bench/bench_nvidia_vs_go.py" "${args[@]}" \
        --deadline "$(($(left) - 20))" "$@"
      ;;
    startup)
      timeout -k 10 "$(($(left) - 5))" "$PY" "$ROOT/bench/bench_startup.py" --runs 7 --libs-floor --python "$PY" \
        2>"$OUT/startup.err" | tee "$OUT/startup.txt"
      ;;
    dra-cpu)
      timeout -k 10 "$(($(left) - 5))" "$PY" "$ROOT/bench/bench_dra_prepare_cpu.py" --rounds 5 --files-floor \
        2>"$OUT/dra-cpu.err" | tee "$OUT/dra-cpu.txt"
      ;;
    *)
      say "unknown bench $bench (KXPU_BENCHES takes nvidia, startup, dra-cpu)"
      false
      ;;
  esac
  rc=$?
  ((rc == 0)) || status=$rc
done
say "benches done with status $status after $((BUDGET - $(left))) s; the environment stays in $VENV"
exit $status
