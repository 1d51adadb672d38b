#!/usr/bin/env bash
# Builds llama.cpp's `llama-server`, and `llama-quantize` and `llama-mtmd-cli` beside it (same cmake tree, bin/), from the
# llama.cpp vendored in the llama-cpp-python source package the `bench` extra pins, for bench.bench_served,
# bench/make_bench_files.sh and bench.bench_vision (llama-mtmd-cli: about a minute more).
# Outside the test set-up: about 9-12 minutes on 2 cores, once.
# Idempotent: a second run prints llama-server's path. Usage: bash bench/build_llama_server.sh  (prints the path last;
# llama-quantize is $(dirname path)/llama-quantize)
# LLAMA_ISA=avx2 builds a second tree, build-avx2/, with AVX2, FMA, F16C and BMI2 only (no AVX-512, no VNNI): the
# llama.cpp of a Zen 3-class CPU, for `python -m bench.bench_served --isa avx2` on an AVX-512 machine.
set -euo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-.venv/bin/python}
spec=${LLAMA_CPP_PYTHON:-"llama-cpp-python>=0.3"}
root=${WEBCHAT_HOME:-$HOME/.cache/webchat}/llama-server
mkdir -p "$root"
sdist=$(ls "$root"/llama_cpp_python-*.tar.gz 2>/dev/null | sort -V | tail -1 || true)
if [ -z "$sdist" ]; then
  "$py" -m pip download -q --disable-pip-version-check --no-binary llama-cpp-python --no-deps "$spec" -d "$root" >&2
  sdist=$(ls "$root"/llama_cpp_python-*.tar.gz | sort -V | tail -1)
fi
version=$(basename "$sdist" .tar.gz)
src="$root/$version"
isa=${LLAMA_ISA:-native}
case "$isa" in
  native) tree="$src/build" ;;
  avx2) tree="$src/build-avx2" ;;
  *) echo "LLAMA_ISA must be native or avx2, got '$isa'" >&2; exit 2 ;;
esac
bin="$tree/bin/llama-server"
if [ ! -x "$bin" ] || [ ! -x "$tree/bin/llama-quantize" ] || [ ! -x "$tree/bin/llama-mtmd-cli" ] || [ "${REBUILD:-0}" = 1 ]; then
  [ -d "$src" ] || tar -xzf "$sdist" -C "$root"
  # This CPU's x86 features, named (GGML_NATIVE would also turn on AMX, which some VMs list in /proc/cpuinfo but do
  # not grant: llama-server then dies with SIGILL at the first matmul).
  flags=(-DGGML_NATIVE=OFF)
  has() { grep -qw "$1" /proc/cpuinfo; }
  has avx && flags+=(-DGGML_AVX=ON); has avx2 && flags+=(-DGGML_AVX2=ON); has fma && flags+=(-DGGML_FMA=ON)
  has f16c && flags+=(-DGGML_F16C=ON); has bmi2 && flags+=(-DGGML_BMI2=ON); has avx_vnni && flags+=(-DGGML_AVX_VNNI=ON)
  if [ "$isa" = avx2 ]; then
    flags=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON
           -DGGML_AVX_VNNI=OFF -DGGML_AVX512=OFF)
  elif has avx512f; then
    flags+=(-DGGML_AVX512=ON)
    has avx512vbmi && flags+=(-DGGML_AVX512_VBMI=ON); has avx512_vnni && flags+=(-DGGML_AVX512_VNNI=ON)
    has avx512_bf16 && flags+=(-DGGML_AVX512_BF16=ON)
  fi
  cmake -S "$src/vendor/llama.cpp" -B "$tree" -DCMAKE_BUILD_TYPE=Release -DLLAMA_BUILD_SERVER=ON "${flags[@]}" \
    -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF \
    -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF >&2
  cmake --build "$tree" --target llama-server llama-quantize llama-mtmd-cli -j "$(nproc)" >&2
fi
echo "$bin"
