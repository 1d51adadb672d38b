"""Decode speed per architecture on the CPU: the C++ forward against PyTorch ops, on the same model in one run.

    .venv/bin/python bench/bench_archs_cpu.py [--quantize q4_1] [--prompt 256] [--tokens 64]

Each architecture is a random model of SmolLM2-135M's shape (576 wide, 30 layers, 9 heads of 64, 3 kv heads, 49152
tokens) built with transformers from its config; Gemma's sliding layers get a window of 128 so that the decode runs
past it. Per architecture and path: a prompt of --prompt tokens, then --tokens greedy decode steps, timed (median of
3 runs alternating the paths; the prompt is not timed). Needs transformers (the `test` or `bench` extra).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import transformers

from webchat.model.loader import load_model

SHAPE: dict[str, Any] = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                             num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=2048,
                             bos_token_id=1, eos_token_id=2, pad_token_id=0)
WINDOW = 128
CONFIGS = {
    "llama": lambda: transformers.LlamaConfig(**SHAPE, head_dim=64),
    "qwen3": lambda: transformers.Qwen3Config(**SHAPE, head_dim=64),
    "phi3": lambda: transformers.Phi3Config(**SHAPE),
    "gemma2": lambda: transformers.Gemma2Config(**SHAPE, head_dim=64, query_pre_attn_scalar=64, sliding_window=WINDOW),
    "gemma3": lambda: transformers.Gemma3TextConfig(**SHAPE, head_dim=64, query_pre_attn_scalar=64,
                                                    sliding_window=WINDOW),
}


def decode_rate(model: Any, prompt: list[int], tokens: int) -> float:
    cache = model.new_cache(len(prompt) + tokens)
    logits = cache.feed(model, prompt)[-1]
    start = time.perf_counter()
    for _ in range(tokens):
        logits = cache.feed(model, [int(logits.argmax())])[-1]
    return tokens / (time.perf_counter() - start)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quantize", default="q4_1", help="q4_0, q4_1, q8_0, or none for float32")
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--arch", choices=list(CONFIGS), action="append")
    args = ap.parse_args()
    quantize = None if args.quantize == "none" else args.quantize
    prompt = torch.randint(3, SHAPE["vocab_size"], (args.prompt,), generator=torch.Generator().manual_seed(0)).tolist()
    print(f"decode tok/s after a {args.prompt}-token prompt, {args.tokens} tokens, weights {args.quantize}, "
          f"{torch.get_num_threads()} threads")
    print("| architecture | C++ forward | PyTorch ops | ratio |")
    print("|---|---:|---:|---:|")
    for arch in args.arch or list(CONFIGS):
        with tempfile.TemporaryDirectory() as tmp:
            torch.manual_seed(0)
            transformers.AutoModelForCausalLM.from_config(CONFIGS[arch]()).float().save_pretrained(Path(tmp))
            model = load_model(Path(tmp), quantize=quantize) if quantize else load_model(Path(tmp), weights="float32")
        runner = model.runner
        if runner is None:
            print(f"| {arch} | declined | | |")
            continue
        rates: dict[str, list[float]] = {"cpp": [], "torch": []}
        for _ in range(3):
            for path in ("cpp", "torch"):
                model.runner = runner if path == "cpp" else None
                rates[path].append(decode_rate(model, prompt, args.tokens))
        cpp, eager = statistics.median(rates["cpp"]), statistics.median(rates["torch"])
        print(f"| {arch} | {cpp:.1f} | {eager:.1f} | {cpp / eager:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
