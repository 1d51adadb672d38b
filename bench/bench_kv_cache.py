"""`--kv-cache f32|f16|q8_0` (webchat.model.kv_format): what each format stores per token, what it changes in the
output, and what it does to decode deep in a conversation, in one process on one loaded model.

    .venv/bin/python -m bench.bench_kv_cache                      # the default file, 8,000 tokens deep
    .venv/bin/python -m bench.bench_kv_cache --gguf PATH --depth 4000 --rounds 3

Per format: KV bytes per token (every layer's k and v); greedy agreement with the float32 cache over the 8 held-out chat
prompts of bench/fidelity_llama_cpp.py and `--more` open questions (32 tokens each, the end of turn banned, fed as the
engine feeds them) and the largest first-token top-5 |Δp|; then one sequence's decode at `--depth` tokens of context
(a prompt of that many tokens cached first), tokens a second over `--steps` steps, the formats alternating for
`--rounds` rounds and each keeping its best, with the KV bytes each step reads (depth x bytes per token) as GB/s.
The model runs at its default precision on THREADS threads.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from bench.bench_precision import greedy, marks
from bench.common import THREADS, default_gguf, table_header, table_row
from bench.fidelity_llama_cpp import PROMPTS
from bench.served_prompts import open_chat
from webchat.kernels.backend import load_model
from webchat.model.batch import make_batch
from webchat.model.kv_cache import PageTable, kv_bytes_per_token
from webchat.model.kv_format import KV_CACHE_TYPES
from webchat.model.transformer import Transformer
from webchat.text.tokenizer import Tokenizer

PAGE, CHUNK = 16, 256


def decode_at_depth(model: Transformer, depth: int, steps: int) -> float:
    """Tokens a second of one sequence's decode with `depth` tokens cached (prefilled in CHUNK-row chunks first)."""
    ids = torch.randint(3, model.args.vocab_size, (depth,), generator=torch.Generator().manual_seed(0)).tolist()
    pool = model.new_pool(depth + steps + 2 * PAGE, PAGE)
    table = PageTable(pool)
    table.ensure(depth + steps)
    for s in range(0, depth, CHUNK):
        model(make_batch([(ids[s : s + CHUNK], s, table.pages, [-1])], PAGE, prompt_ends=[depth]), pool)
    t0 = time.perf_counter()
    for s in range(steps):
        model(make_batch([([5], depth + s, table.pages, [-1])], PAGE, prompt_ends=[depth]), pool)
    return steps / (time.perf_counter() - t0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gguf", type=Path, default=None, help="default: the default model's GGUF")
    parser.add_argument("--depth", type=int, default=8000, help="tokens of context for the decode column")
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--more", type=int, default=0, help="open questions beside the 8 held-out prompts")
    parser.add_argument("--tokens", type=int, default=32)
    args = parser.parse_args()
    torch.set_num_threads(THREADS)
    from webchat.files.gguf_cache import model_folder

    gguf = args.gguf or default_gguf()
    folder = model_folder(gguf)
    model = load_model(folder)
    tok = Tokenizer.from_dir(folder)
    if args.depth + args.steps > model.args.max_seq_len:
        raise SystemExit(f"--depth {args.depth} + --steps {args.steps} is past the model's context "
                         f"({model.args.max_seq_len})")
    prompts = [tok.encode_chat(m) for m in PROMPTS + [open_chat(i) for i in range(args.more)]]
    banned = tok.stop_token_ids
    print(f"{gguf.name}, precision {model.precision}, {THREADS} threads; {len(prompts)} prompts x {args.tokens} "
          f"greedy tokens; decode {args.steps} steps at {args.depth} tokens deep, best of {args.rounds}", flush=True)
    runs, per_token = {}, {}
    for kind in KV_CACHE_TYPES:
        model.kv_cache = kind
        per_token[kind] = kv_bytes_per_token(model.args, model.dtype, kind)
        runs[kind] = [greedy(model, ids, banned, args.tokens) for ids in prompts]
    best = {kind: 0.0 for kind in KV_CACHE_TYPES}
    for _ in range(args.rounds):
        for kind in KV_CACHE_TYPES:
            model.kv_cache = kind
            best[kind] = max(best[kind], decode_at_depth(model, args.depth, args.steps))
    print()
    print(table_header("--kv-cache", "KV bytes/token", "of f16's", f"greedy = f32 ({len(prompts)})", "tokens kept",
                       "first-token top-5 max |Δp|", f"decode at {args.depth} tok/s", "KV read GB/s"))
    for kind in KV_CACHE_TYPES:
        m = marks(runs["f32"], runs[kind], args.tokens)
        gbps = per_token[kind] * args.depth * best[kind] / 1e9
        print(table_row(kind, f"{per_token[kind]:,}", f"{per_token[kind] / per_token['f16']:.3f}",
                        f"{m.equal}/{len(prompts)}", f"{m.kept:.1f}", f"{m.dp_first:.1e}", f"{best[kind]:.1f}",
                        f"{gbps:.1f}"))


if __name__ == "__main__":
    main()
