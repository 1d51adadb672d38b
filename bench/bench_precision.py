"""Issue 64's question: what each precision gives up against float32, and what it buys, in one table. Per file, code
path and precision (exact, int8, int8x2, in one process on one loaded model): how many greedy continuations equal the
reference token for token, the mean tokens kept before the first divergence, the largest first-token top-5 |Δp|, and
the decode speed of one sequence.

    .venv/bin/python -m bench.bench_precision                          # the default file and its Q4_K_M requantized
    .venv/bin/python -m bench.bench_precision --files all --more 8     # and issue 38's 1.1B files (make_bench_files)
    .venv/bin/python -m bench.bench_precision --paths native,avx2      # and the AVX2 class's kernels

The reference is transformers in float32 on the file's own dequantized weights (bench/fidelity_llama_cpp.py's, the
SmolLM2 files) or, where it is not asked for (`--reference exact`: the 1.1B files' random weights), webchat's exact
path, which sits within float rounding of it (bench/README.md: 8/8 and 48/48, |Δp| 6e-6). Prompts: the 8 held-out chat
prompts of fidelity_llama_cpp and `--more` open questions, 32 greedy tokens with the end of turn banned, fed as the
engine feeds them (the prompt's rows marked, in 256-row chunks, then one row a step). The decode column: one
sequence, THREADS threads (`--threads`), 64 steps after a 300-token prompt, each precision's best of `--rounds`, the
precisions alternating. `--paths avx2` forces the kernels of the AVX2 class (WEBCHAT_QPATH=avx2 WEBCHAT_VNNI=0, no AMX)
in process; the reference stays the native exact path's or transformers'.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from bench.common import THREADS, default_gguf, table_header, table_row
from bench.fidelity_llama_cpp import PROMPTS, TOP, Run, reference_runs
from bench.served_files import bench_files_dir
from bench.served_prompts import open_chat
from webchat.kernels.backend import load_model
from webchat.kernels.cpu import build
from webchat.model.batch import make_batch
from webchat.model.kv_cache import PageTable
from webchat.model.precision import set_precision
from webchat.model.transformer import Transformer

PAGE, CHUNK = 16, 256
PRECISIONS = ("exact", "int8", "int8x2")
SMOLLM = ("default", "smollm2-135m-q4_k_m.gguf")
LARGE = ("tinyllama-shape-q4_0.gguf", "tinyllama-shape-q4_1.gguf", "tinyllama-shape-q8_0.gguf",
         "tinyllama-shape-q4_k_m.gguf")


@dataclass
class Marks:
    equal: int
    equal_first8: int
    kept: float
    dp_first: float


def greedy(model: Transformer, ids: list[int], banned: list[int], n: int) -> Run:
    """n greedy tokens as the engine computes them: the prompt's rows marked as a prompt, in CHUNK-row chunks, then a
    row a step; the top-5 of each step's softmax (float64)."""
    pool = model.new_pool(len(ids) + n + 2 * PAGE, PAGE)
    table = PageTable(pool)
    table.ensure(len(ids) + n)
    run = Run([], [])
    logits = torch.empty(0)
    for s in range(0, len(ids), CHUNK):
        logits = model(make_batch([(ids[s : s + CHUNK], s, table.pages, [-1])], PAGE, prompt_ends=[len(ids)]), pool)
    for step in range(n):
        if step:
            batch = make_batch([([run.tokens[-1]], len(ids) + step - 1, table.pages, [-1])], PAGE,
                               prompt_ends=[len(ids)])
            logits = model(batch, pool)
        row = logits[-1].double()
        top = torch.topk(torch.softmax(row, -1), TOP)
        run.tops.append({int(i): float(p) for p, i in zip(top.values, top.indices, strict=True)})
        row[banned] = -math.inf
        run.tokens.append(int(row.argmax()))
    pool.release(table.pages)
    return run


def marks(ref: list[Run], got: list[Run], n: int) -> Marks:
    firsts = [next((i for i, (a, b) in enumerate(zip(r.tokens, g.tokens, strict=True)) if a != b), None)
              for r, g in zip(ref, got, strict=True)]
    dps = []
    for r, g in zip(ref, got, strict=True):
        rt, gt = r.tops[0], g.tops[0]
        assert rt is not None and gt is not None
        dps.append(max(abs(gt[i] - p) for i, p in rt.items() if i in gt))
    return Marks(sum(f is None for f in firsts), sum(f is None for f in firsts[: len(PROMPTS)]),
                 statistics.mean(n if f is None else f for f in firsts), max(dps))


def decode_tok_s(model: Transformer, kernels: Any, rounds: int, steps: int = 64) -> dict[str, float]:
    """One sequence's decode after a 300-token prompt: tokens a second, each precision's best round, alternating."""
    ids = torch.randint(3, model.args.vocab_size, (300,), generator=torch.Generator().manual_seed(0)).tolist()
    best = {p: 0.0 for p in PRECISIONS}
    for _ in range(rounds):
        for p in PRECISIONS:
            set_precision(model, p, kernels)
            pool = model.new_pool(300 + steps + 2 * PAGE, PAGE)
            table = PageTable(pool)
            table.ensure(300 + steps)
            model(make_batch([(ids, 0, table.pages, [-1])], PAGE, prompt_ends=[300]), pool)
            t0 = time.perf_counter()
            for s in range(steps):
                model(make_batch([([5], 300 + s, table.pages, [-1])], PAGE, prompt_ends=[300]), pool)
            best[p] = max(best[p], steps / (time.perf_counter() - t0))
    return best


def force_path(kernels: Any, name: str) -> str:
    """The kernels of `name` (native: this CPU's best; avx2: the AVX2 class, no VNNI, no AMX); its label."""
    if name == "avx2":
        kernels.set_path(build.PATHS["avx2"]), kernels.set_vnni(0), kernels.set_amx(0)
        return "avx2 (no VNNI, no AMX)"
    kernels.set_path(-1), kernels.set_vnni(-1), kernels.set_amx(-1)
    running = build.running() or {}
    extras = [x for x in ("vnni", "amx") if running.get(x)]
    return f"{build.path_name(kernels)}{''.join(' +' + x.upper() for x in extras)}"


def resolve(name: str) -> Path:
    if name == "default":
        return default_gguf()
    path = Path(name).expanduser()
    return path if path.exists() else bench_files_dir() / name


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--files", default="smollm", help="smollm (the default file and its Q4_K_M requantized), large "
                    "(issue 38's 1.1B Q4_0, Q4_1, Q8_0, Q4_K_M), all, or comma-separated names/paths (default: the "
                    "default file)")
    ap.add_argument("--paths", default="native", help="comma-separated: native, avx2")
    ap.add_argument("--more", type=int, default=0, help="open questions after the 8 held-out prompts")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3, help="decode rounds per precision (best kept)")
    ap.add_argument("--threads", type=int, default=THREADS, help="torch's threads (the decode column's)")
    ap.add_argument("--reference", choices=["auto", "transformers", "exact"], default="auto",
                    help="auto: transformers for the SmolLM2 files, webchat's exact path for the 1.1B files")
    args = ap.parse_args()
    from webchat.files.gguf_cache import model_folder
    from webchat.text.tokenizer import Tokenizer

    names = {"smollm": list(SMOLLM), "large": list(LARGE), "all": [*SMOLLM, *LARGE]}.get(args.files)
    files = [resolve(n) for n in (names if names is not None else args.files.split(","))]
    missing = [str(f) for f in files if not f.exists()]
    if missing:
        raise SystemExit(f"missing: {', '.join(missing)} (bash bench/make_bench_files.sh writes them)")
    torch.set_num_threads(args.threads)
    kernels = build.load()
    rows = []
    print(f"{len(PROMPTS)} held-out chat prompts and {args.more} open questions, {args.tokens} greedy tokens (end of "
          f"turn banned), {args.threads} threads", flush=True)
    for gguf in files:
        folder = model_folder(gguf)
        tok = Tokenizer.from_dir(folder)
        ids = [tok.encode_chat(m) for m in PROMPTS + [open_chat(i) for i in range(args.more)]]
        banned = tok.stop_token_ids
        model = load_model(folder)
        default = model.precision
        use_hf = args.reference == "transformers" or (args.reference == "auto" and "tinyllama" not in gguf.name)
        force_path(kernels, "native")
        if use_hf:
            ref, hf = reference_runs(gguf, ids, banned, args.tokens)
            del hf
            ref_name = "transformers float32"
        else:
            set_precision(model, "exact", kernels)
            ref = [greedy(model, i, banned, args.tokens) for i in ids]
            ref_name = "webchat exact (native)"
        print(f"{gguf.name}: default precision {default}; reference {ref_name}", flush=True)
        for path in args.paths.split(","):
            label = force_path(kernels, path)
            speed = decode_tok_s(model, kernels, args.rounds)
            for p in PRECISIONS:
                set_precision(model, p, kernels)
                m = marks(ref, [greedy(model, i, banned, args.tokens) for i in ids], args.tokens)
                name = f"**{p}**" if p == default else p
                rows.append(table_row(gguf.name, label, name, f"{m.equal_first8}/{len(PROMPTS)}",
                                      f"{m.equal}/{len(ids)}", f"{m.kept:.1f}", f"{m.dp_first:.1e}",
                                      f"{speed[p]:.1f}"))
                print(rows[-1], flush=True)
        force_path(kernels, "native")
        del model
    print("\n" + table_header("file", "kernels", "precision (bold: the default)", "8: greedy = ref.",
                              f"all {len(PROMPTS) + args.more}: greedy = ref.", "tokens kept",
                              "first token top-5 max |Δp|", "decode tok/s, 1 seq.", align="lllrrrrr"))
    print("\n".join(rows))


if __name__ == "__main__":
    main()
