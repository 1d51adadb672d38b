#!/usr/bin/env bash
# Sets webchat up in ./.venv: PyTorch (the CPU build where no NVIDIA GPU is present), the package, and with --test
# the test dependencies and Debian's Chromium for the browser tests. Idempotent: a second run only checks.
set -euo pipefail
cd "$(dirname "$0")/.."

with_tests=0
for arg in "$@"; do
  case "$arg" in
    --test) with_tests=1 ;;
    *) echo "setup.sh: unknown argument '$arg' (expected --test)" >&2; exit 2 ;;
  esac
done

py=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$py" -m venv .venv
pip=(.venv/bin/python -m pip -q --disable-pip-version-check)

has_cuda=0
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then has_cuda=1; fi

# PyTorch first, so that the package's `torch` range is already satisfied and pip pulls nothing bigger.
if ! .venv/bin/python -c "import torch" >/dev/null 2>&1; then
  if [ "$has_cuda" = 1 ]; then
    "${pip[@]}" install "${WEBCHAT_TORCH:-torch}"
  else
    # The CPU build. Where PyPI serves only CUDA builds, point pip at a CPU index with PIP_EXTRA_INDEX_URL.
    "${pip[@]}" install "${WEBCHAT_TORCH:-torch==2.13.0}"
  fi
fi

extras=""
[ "$with_tests" = 1 ] && extras="test"
if [ "$has_cuda" = 1 ]; then  # CuPy for the CUDA major version torch was built with (extras cuda12, cuda13)
  cuda_major=$(.venv/bin/python -c 'import torch; print((torch.version.cuda or "").split(".")[0])')
  case "$cuda_major" in
    12|13) extras="${extras:+$extras,}cuda$cuda_major" ;;
    *) echo "setup.sh: torch reports CUDA '${cuda_major}'; no CuPy extra for it, the model will run on PyTorch ops" >&2 ;;
  esac
fi
"${pip[@]}" install -e ".${extras:+[$extras]}"

# webchat's C++ CPU kernels (quantized matmul, decode step): g++ and ninja, built once into $WEBCHAT_HOME/build.
if ! command -v g++ >/dev/null 2>&1; then
  sudo=""; [ "$(id -u)" = 0 ] || sudo="sudo"
  $sudo apt-get update -qq && $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq g++ >/dev/null || true
fi
.venv/bin/python -m webchat.kernels.cpu.build \
  || echo "setup.sh: the C++ kernels did not build; webchat will run the float32 weights on the CPU" >&2

if [ "$with_tests" = 1 ] && ! command -v chromium >/dev/null 2>&1; then
  sudo=""; [ "$(id -u)" = 0 ] || sudo="sudo"
  $sudo apt-get update -qq
  $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null
fi
# axe-core (the accessibility checker the e2e tests inject) from the npm registry, pinned, into e2e/vendor/ (ignored)
AXE_VERSION=4.14.1
if [ "$with_tests" = 1 ] && ! grep -qs "axe v$AXE_VERSION" e2e/vendor/axe.min.js; then
  command -v npm >/dev/null 2>&1 || { sudo=""; [ "$(id -u)" = 0 ] || sudo="sudo"; $sudo apt-get update -qq;
    $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq npm >/dev/null; }
  tmp=$(mktemp -d)
  (cd "$tmp" && npm pack --silent "axe-core@$AXE_VERSION" >/dev/null && tar -xzf "axe-core-$AXE_VERSION.tgz")
  mkdir -p e2e/vendor && cp "$tmp/package/axe.min.js" e2e/vendor/axe.min.js && rm -rf "$tmp"
fi
echo "webchat is set up in .venv ($(.venv/bin/python -c 'import torch; print("torch", torch.__version__)'))"
