#!/usr/bin/env bash
# The GPU checks of docs/gpu.md in as few device calls as the 64 MiB carry limit allows. The default model's GGUF
# (94 MB) travels in two halves, so it takes two calls on the same warm machine:
#
#   here:                 bash bench/device_run.sh prepare      # .device/a (half 1, gguf wheel), .device/b (half 2),
#                                                               # both ignored by git (/.device/ in .gitignore)
#   device call 1:        bash bench/device_run.sh stage        # carry [".device/a"]: keeps half 1 in /tmp
#   device call 2 (<30s): bash bench/device_run.sh check        # carry [".device/b"]: joins, tests, benchmarks
#
# `check` writes pytest.log, bench_gpu.txt and bench_gpu.json (batch sweep 1, 4, 16, 64) under $OUT. If the machine
# went back between the calls, `check` says so and runs everything that needs no real model. `check` also runs here
# (no GPU: the GPU tests skip and the benchmark makes a dry run), which is how this script itself is tested.
set -uo pipefail
cd "$(dirname "$0")/.."

STAGE=/tmp/webchat-stage
GGUF_NAME=SmolLM2-135M-Instruct.Q4_1.gguf
GGUF_SHA256=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
GGUF_VERSION=0.19.0

prepare() {
  set -e
  local py=.venv/bin/python gguf
  gguf=$("$py" -c 'from webchat.files.pull import ensure_default_gguf; print(ensure_default_gguf())')
  rm -rf .device && mkdir -p .device/a .device/b
  split -n 2 -d "$gguf" .device/part.
  mv .device/part.00 .device/a/ && mv .device/part.01 .device/b/
  "$py" -m pip download -q --no-deps --only-binary=:all: "gguf==$GGUF_VERSION" -d .device/a
  du -sh .device/a .device/b
}

stage() {
  mkdir -p "$STAGE" && cp .device/a/* "$STAGE"/ && ls -la "$STAGE"
}

check() {
  local out=${OUT:-/tmp/webchat-device-out} py=.venv/bin/python real=1
  mkdir -p "$out"
  export PYTHONUNBUFFERED=1
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    # the device: its own python3 (torch, cupy, transformers), webchat installed without dependencies, the model
    # joined from the two carried halves into a fresh WEBCHAT_HOME
    py=python3
    export WEBCHAT_HOME=/tmp/webchat-home
    mkdir -p "$WEBCHAT_HOME/gguf"
    if [ -f "$STAGE/part.00" ] && [ -f .device/b/part.01 ]; then
      cat "$STAGE/part.00" .device/b/part.01 >"$WEBCHAT_HOME/gguf/$GGUF_NAME"
      echo "$GGUF_SHA256  $WEBCHAT_HOME/gguf/$GGUF_NAME" | sha256sum -c - || real=0
    else
      echo "device_run.sh: the model's two halves are not both here (was the machine given back after 'stage'?);"
      echo "running only what needs no real model"
      real=0
    fi
    "$py" -m pip install -q --no-deps --no-build-isolation --no-index -e . || return 1
    if ls "$STAGE"/gguf-*.whl >/dev/null 2>&1; then
      "$py" -m pip install -q --no-deps --no-index --target /tmp/site "$STAGE"/gguf-*.whl && export PYTHONPATH=/tmp/site
    fi
  fi
  { nvidia-smi -L 2>/dev/null; "$py" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)'; } \
    | tee "$out/device.txt"
  if [ "$real" = 1 ]; then
    "$py" -c 'from webchat.files.pull import ensure_default_model as e; print("model:", e())' 2>&1 | tail -1 || real=0
  fi
  local marks="not e2e" models=(default "Llama-3.2-1B shape" "Llama-3.1-8B shape") dry=()
  if [ "$real" = 0 ]; then
    marks="not e2e and not real_model"
    models=("Llama-3.2-1B shape" "Llama-3.1-8B shape")
  fi
  "$py" -c 'import torch, sys; sys.exit(not torch.cuda.is_available())' || dry=(--dry-run)
  "$py" -m pytest -p no:cacheprovider -q -rs -m "$marks" tests/kernels/test_kernels.py tests/kernels/test_paged_kernels.py \
    tests/kernels/test_gpu_model.py tests/kernels/test_emulator.py tests/kernels/test_nvcc.py tests/kernels/test_nvrtc.py 2>&1 \
    | tee "$out/pytest.log" | tail -25
  "$py" -m bench.bench_gpu "${dry[@]}" --models "${models[@]}" --json "$out/bench_gpu.json" 2>&1 \
    | grep -v "^Loading weights" | tee "$out/bench_gpu.txt" | tail -20
}

case "${1:-}" in
  prepare) prepare ;;
  stage) stage ;;
  check) check ;;
  *) echo "usage: bench/device_run.sh prepare|stage|check (see the comment at the top)" >&2; exit 2 ;;
esac
