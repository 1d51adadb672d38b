"""CPU figures for the default model: time to first token and decode tokens/s for webchat, transformers and llama.cpp.

Each engine runs in its own child process so that its peak memory (VmHWM) is its own, with 2 threads (torch's
intra-op threads, llama.cpp's n_threads). Greedy, a fixed number of new tokens (stop tokens ignored), a warm-up run
first; `--rounds N` (default 3) runs the engines' children in turn N times and keeps each engine's best round, so the
machine's noise (up to 30% between runs here) falls on every engine alike. webchat's KV cache is sized to prompt +
new tokens, not the model's 8192 context. `webchat` runs the folder's quantized Q4_1 blocks (docs/quant.md),
`webchat-f32` the float32 weights. A last child measures fidelity: the max |Δlogit| of webchat q4_1 and of llama.cpp
against webchat's float32 model (the same dequantized weights), at the end of each prompt and over the reference's
next greedy tokens fed to all three.
Run: `.venv/bin/python -m bench.bench_cpu` (llama.cpp needs the `bench` extra: `.venv/bin/pip install -e .[bench]`,
which compiles llama.cpp for about 12 minutes).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from bench.common import ROOT, table_header, table_row

SHORT = [{"role": "user", "content": "What is the capital of France?"}]
LONG_TEXT = (
    "Here are my notes from the meeting. We discussed the quarterly roadmap, the hiring plan for the platform team, "
    "the migration of the billing service to the new database cluster, and the incident from last Tuesday when the "
    "cache layer returned stale prices for about forty minutes. The action items were: write a postmortem, add an "
    "alert on cache age, review the rollout checklist, and schedule a load test before the holiday freeze. Marta "
    "owns the postmortem, Jun owns the alert, and I own the checklist. The load test needs a date and an owner. "
    "Finance asked for a cost estimate of the new cluster by Friday, and legal wants the data retention policy "
    "reviewed. Please summarise these notes as a short list of decisions and open questions."
)
LONG = [{"role": "user", "content": LONG_TEXT}]
NEW_TOKENS = 64
THREADS = 2
FIDELITY_STEPS = 16
ENGINES = ("webchat", "webchat-1t", "webchat-f32", "transformers", "llama.cpp")


def peak_rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def time_stream(step_iter: Callable[[], object]) -> tuple[float, float]:
    """Run one generation; step_iter yields once per new token. Returns (ttft ms, decode tok/s)."""
    t0 = time.perf_counter()
    stamps = []
    for _ in step_iter():  # type: ignore[attr-defined]
        stamps.append(time.perf_counter())
    ttft = (stamps[0] - t0) * 1000
    decode = (len(stamps) - 1) / (stamps[-1] - stamps[0])
    return ttft, decode


def webchat_runner(model_dir: Path, gguf: Path, weights: str = "auto") -> Callable[[list[int]], Callable[[], object]]:
    from webchat.kernels.backend import load_model

    model = load_model(model_dir, weights=weights)

    def run(ids: list[int]) -> Callable[[], object]:
        def steps() -> object:
            cache = model.new_cache(len(ids) + NEW_TOKENS)
            x = ids
            for _ in range(NEW_TOKENS):
                x = [int(cache.feed(model, x)[-1].argmax())]
                yield x[0]

        return steps

    return run


def transformers_runner(model_dir: Path, gguf: Path) -> Callable[[list[int]], Callable[[], object]]:
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    def run(ids: list[int]) -> Callable[[], object]:
        def steps() -> object:
            x, past = torch.tensor([ids]), transformers.DynamicCache()
            with torch.no_grad():
                for _ in range(NEW_TOKENS):
                    out = model(x, past_key_values=past, use_cache=True)
                    x = out.logits[:, -1].argmax(-1, keepdim=True)
                    yield int(x)

        return steps

    return run


def llamacpp_runner(model_dir: Path, gguf: Path) -> Callable[[list[int]], Callable[[], object]]:
    import llama_cpp

    llm = llama_cpp.Llama(model_path=str(gguf), n_ctx=2048, n_threads=THREADS, n_threads_batch=THREADS, n_batch=512,
                          verbose=False)

    def run(ids: list[int]) -> Callable[[], object]:
        def steps() -> object:
            llm.reset()
            for i, tok in enumerate(llm.generate(ids, top_k=1, temp=0.0, reset=True)):
                yield tok
                if i + 1 == NEW_TOKENS:
                    break

        return steps

    return run


def webchat_f32_runner(model_dir: Path, gguf: Path) -> Callable[[list[int]], Callable[[], object]]:
    return webchat_runner(model_dir, gguf, weights="float32")


RUNNERS = {"webchat": webchat_runner, "webchat-1t": webchat_runner, "webchat-f32": webchat_f32_runner,
           "transformers": transformers_runner, "llama.cpp": llamacpp_runner}


def prompts_of(model_dir: Path) -> dict[str, list[int]]:
    from webchat.text.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(model_dir)
    return {name: tok.encode(tok.apply_chat_template(m)) for name, m in (("short", SHORT), ("long", LONG))}


def fidelity() -> None:
    """Max |Δlogit| against webchat float32, at each prompt's end and over FIDELITY_STEPS teacher-forced tokens."""
    import llama_cpp
    import numpy as np
    import torch

    from webchat.files.home import default_gguf_path
    from webchat.files.pull import ensure_default_model
    from webchat.kernels.backend import load_model
    from webchat.model.loader import weights_name

    torch.set_num_threads(THREADS)
    model_dir = ensure_default_model()
    ref, ours = load_model(model_dir, weights="float32"), load_model(model_dir)
    llm = llama_cpp.Llama(model_path=str(default_gguf_path()), n_ctx=2048, n_threads=THREADS, verbose=False)
    vocab = ref.args.vocab_size
    result: dict[str, object] = {"weights": weights_name(ours)}
    for name, ids in prompts_of(model_dir).items():
        c_ref, c_ours = ref.new_cache(len(ids) + FIDELITY_STEPS), ours.new_cache(len(ids) + FIDELITY_STEPS)
        llm.reset()
        feed, d_ours, d_llama, flips = list(ids), 0.0, 0.0, 0
        for _ in range(FIDELITY_STEPS):
            want = c_ref.feed(ref, feed)[-1]
            got = c_ours.feed(ours, feed)[-1]
            llm.eval(feed)
            row = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), (vocab,))
            theirs = torch.from_numpy(row.copy())
            d_ours = max(d_ours, (got - want).abs().max().item())
            d_llama = max(d_llama, (theirs - want).abs().max().item())
            flips += int(theirs.argmax() != want.argmax())
            nxt = int(want.argmax())
            feed = [nxt]
        result[name] = {"webchat": d_ours, "llama.cpp": d_llama, "llama_top1_flips": flips}
    print(json.dumps(result))


def child(engine: str, repeat: bool = False) -> None:
    import torch

    from webchat.files.home import default_gguf_path
    from webchat.files.pull import ensure_default_model

    torch.set_num_threads(1 if engine == "webchat-1t" else THREADS)  # 1t: one thread, for comparison under load
    model_dir = ensure_default_model()
    prompts = prompts_of(model_dir)
    run = RUNNERS[engine](model_dir, default_gguf_path())
    time_stream(run(prompts["short"][:8]))  # warm-up
    if repeat:  # bench_served --paired: one short-prompt run per line read, its figures printed at once
        print(json.dumps({"ready": True}), flush=True)
        for _ in sys.stdin:
            ttft, tps = time_stream(run(prompts["short"]))
            print(json.dumps({"ttft_ms": round(ttft, 1), "decode_tps": round(tps, 1)}), flush=True)
        return
    result: dict[str, object] = {"engine": engine}
    for name, ids in prompts.items():
        ttft, tps = min((time_stream(run(ids)) for _ in range(2)), key=lambda r: r[0])
        result[name] = {"prompt_tokens": len(ids), "ttft_ms": round(ttft, 1), "decode_tps": round(tps, 1)}
    result["peak_rss_mb"] = round(peak_rss_mb())
    print(json.dumps(result))


def run_child(*args: str) -> dict[str, object] | None:
    proc = subprocess.run([sys.executable, "-m", "bench.bench_cpu", *args], cwd=ROOT, capture_output=True, text=True)
    if proc.returncode:
        print(f"{' '.join(args)}: failed\n{proc.stderr.strip().splitlines()[-1:]}", file=sys.stderr)
        return None
    out: dict[str, object] = json.loads(proc.stdout.strip().splitlines()[-1])
    return out


def best_round(rounds: list[dict[str, object]]) -> dict[str, object]:
    """One engine's rounds folded: the fastest decode and TTFT per prompt, the largest peak RSS."""
    best: dict[str, object] = {"engine": rounds[0]["engine"], "peak_rss_mb": max(r["peak_rss_mb"] for r in rounds)}  # type: ignore[type-var]
    for prompt in ("short", "long"):
        stats = [r[prompt] for r in rounds]
        best[prompt] = {"prompt_tokens": stats[0]["prompt_tokens"],  # type: ignore[index]
                        "ttft_ms": min(s["ttft_ms"] for s in stats),  # type: ignore[index]
                        "decode_tps": max(s["decode_tps"] for s in stats)}  # type: ignore[index]
    return best


def print_ratios(rows: list[dict[str, object]]) -> None:
    by = {str(r["engine"]): r for r in rows}
    if "webchat" not in by or "llama.cpp" not in by:
        return
    w, ll = by["webchat"], by["llama.cpp"]

    def get(r: dict[str, object], prompt: str, key: str) -> float:
        return float(r[prompt][key])  # type: ignore[index]

    print("webchat (q4_1) / llama.cpp:")
    for prompt in ("short", "long"):
        print(f"  decode tok/s, {prompt} prompt: {get(w, prompt, 'decode_tps') / get(ll, prompt, 'decode_tps'):.2f}x"
              "  (target >= 1)")
    print(f"  TTFT, long prompt: {get(w, 'long', 'ttft_ms') / get(ll, 'long', 'ttft_ms'):.2f}x  (target <= 1)")
    print(f"  peak RSS: {float(w['peak_rss_mb']) / float(ll['peak_rss_mb']):.2f}x  (target <= 1.5)")  # type: ignore[arg-type]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--engine", choices=ENGINES, help="run one engine (the parent runs each in a child)")
    parser.add_argument("--fidelity", action="store_true", help="run the fidelity child only")
    parser.add_argument("--repeat", action="store_true",
                        help="with --engine: stay, and run the short prompt once for each line read on stdin")
    parser.add_argument("--engines", default=",".join(ENGINES))
    parser.add_argument("--rounds", type=int, default=3,
                        help="children per engine, engines alternating; each engine's best round is kept (the "
                             "machine's noise hits every engine alike)")
    args = parser.parse_args()
    if args.engine:
        child(args.engine, args.repeat)
        return
    if args.fidelity:
        fidelity()
        return
    runs: dict[str, list[dict[str, object]]] = {}
    for _ in range(args.rounds):
        for e in args.engines.split(","):
            r = run_child("--engine", e)
            if r is not None:
                runs.setdefault(e, []).append(r)
    rows = [best_round(rs) for rs in runs.values()]
    print(f"greedy, {NEW_TOKENS} new tokens, best of {2 * args.rounds} ({args.rounds} rounds, engines alternating), "
          f"{THREADS} threads each, KV cache = prompt + new tokens; peak RSS: the largest of the rounds")
    print(table_header("engine", "short prompt, tokens", "TTFT ms", "decode tok/s", "long prompt, tokens", "TTFT ms",
                       "decode tok/s", "peak RSS MB"))
    for r in rows:
        s, lg = r["short"], r["long"]
        print(table_row(r["engine"], s["prompt_tokens"], s["ttft_ms"], s["decode_tps"],  # type: ignore[index]
                        lg["prompt_tokens"], lg["ttft_ms"], lg["decode_tps"], r["peak_rss_mb"]))  # type: ignore[index]
    print_ratios(rows)
    fid = run_child("--fidelity") if "llama.cpp" in args.engines else None
    if fid is not None:
        print(f"max |Δlogit| vs webchat float32 (prompt end + {FIDELITY_STEPS} teacher-forced tokens):")
        for prompt in ("short", "long"):
            f = fid[prompt]
            print(f"  {prompt}: webchat {fid['weights']} {f['webchat']:.2e}   llama.cpp {f['llama.cpp']:.2e} "  # type: ignore[index]
                  f"(top-1 differs on {f['llama_top1_flips']} of {FIDELITY_STEPS})")  # type: ignore[index]


if __name__ == "__main__":
    main()
