#!/usr/bin/env bash
# Issue 38's bench files, made as a user's downloads are made: by llama.cpp's own `llama-quantize` (built beside
# llama-server by bench/build_llama_server.sh) from a float16 source, into $WEBCHAT_HOME/bench-files/:
#   tinyllama-shape-f16.gguf          the 1.1B Llama shape, random weights (bench.make_tinyllama_gguf --type f16)
#   tinyllama-shape-{q4_0,q4_1,q8_0,q4_k_m,q5_k_m,q6_k}.gguf   llama-quantize of it
#   llama32-3b-shape-q4_k_m.gguf      Llama-3.2-3B's shape, 128,256 tokens, tied, random weights: llama-quantize of a
#                                     6.4 GB float16 source that is deleted afterwards (KEEP_F16=1 keeps it)
#   llama31-8b-shape-q4_k_m.gguf      only with WITH_8B=1: Llama-3.1-8B's shape (4.9 GB), from a 16.1 GB float16 source
#                                     deleted afterwards (~21 GB of disk at the peak, ~40 more minutes)
#   smollm2-135m-q4_k_m.gguf          the real default model requantized to Q4_K_M: `llama-quantize --allow-requantize`
#                                     of its Q4_1 GGUF (the fidelity figures of issue 38 were made so; the Q4_1 rounding
#                                     is in the weights both sides dequantize)
# Deterministic (seed 0; llama-quantize's rounding is per block) and idempotent: a file that exists is kept, each is
# written under .part and renamed. Heavy steps run under `nice -n 10`; about 30 minutes on 2 cores the first time,
# ~13 GB of disk at the peak (the 3B's source). Prints each file's path.
#   bash bench/make_bench_files.sh
set -euo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-.venv/bin/python}
out=${WEBCHAT_HOME:-$HOME/.cache/webchat}/bench-files
mkdir -p "$out"
server=$(bash bench/build_llama_server.sh)
quantize=$(dirname "$server")/llama-quantize
[ -x "$quantize" ] || { echo "no llama-quantize beside $server: run REBUILD=1 bash bench/build_llama_server.sh" >&2; exit 1; }

make_source() {  # shape type -> $out/<shape>-shape-<type>.gguf
  local dest=$out/$1-shape-$2.gguf
  [ -f "$dest" ] || nice -n 10 "$py" -m bench.make_tinyllama_gguf --shape "$1" --type "$2" --out "$dest" >&2
}

quantize_to() {  # source dest TYPE [flags...]
  local src=$1 dest=$2 type=$3
  shift 3
  if [ ! -f "$dest" ]; then
    nice -n 10 "$quantize" "$@" "$src" "$dest.part" "$type" 2 >&2
    mv "$dest.part" "$dest"
  fi
  echo "$dest"
}

make_source tinyllama f16
echo "$out/tinyllama-shape-f16.gguf"
for type in q4_0 q4_1 q8_0 q4_k_m q5_k_m q6_k; do
  quantize_to "$out/tinyllama-shape-f16.gguf" "$out/tinyllama-shape-$type.gguf" "${type^^}"
done

if [ ! -f "$out/llama32-3b-shape-q4_k_m.gguf" ]; then
  make_source llama32-3b f16
  quantize_to "$out/llama32-3b-shape-f16.gguf" "$out/llama32-3b-shape-q4_k_m.gguf" Q4_K_M >/dev/null
  [ "${KEEP_F16:-0}" = 1 ] || rm -f "$out/llama32-3b-shape-f16.gguf"
fi
echo "$out/llama32-3b-shape-q4_k_m.gguf"

if [ "${WITH_8B:-0}" = 1 ] && [ ! -f "$out/llama31-8b-shape-q4_k_m.gguf" ]; then
  make_source llama31-8b f16
  quantize_to "$out/llama31-8b-shape-f16.gguf" "$out/llama31-8b-shape-q4_k_m.gguf" Q4_K_M >/dev/null
  [ "${KEEP_F16:-0}" = 1 ] || rm -f "$out/llama31-8b-shape-f16.gguf"
fi
[ ! -f "$out/llama31-8b-shape-q4_k_m.gguf" ] || echo "$out/llama31-8b-shape-q4_k_m.gguf"

default=$("$py" -c "from webchat.files.pull import ensure_default_gguf; print(ensure_default_gguf())")
quantize_to "$default" "$out/smollm2-135m-q4_k_m.gguf" Q4_K_M --allow-requantize
