"""CPU figures for the default model: time to first token and decode tokens/s for webchat, transformers and llama.cpp.

Each engine runs in its own child process so that its peak memory (VmHWM) is its own. Greedy, a fixed number of new
tokens (stop tokens ignored), a warm-up run first. Run: `.venv/bin/python bench/bench_cpu.py` (llama.cpp needs the
`bench` extra: `.venv/bin/pip install -e .[bench]`, which compiles llama.cpp for about 12 minutes).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

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
ENGINES = ("webchat", "transformers", "llama.cpp")


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


def webchat_runner(model_dir: Path, gguf: Path) -> Callable[[list[int]], Callable[[], object]]:
    from webchat.loader import load_model

    model = load_model(model_dir)

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

    llm = llama_cpp.Llama(model_path=str(gguf), n_ctx=2048, n_threads=2, n_batch=512, verbose=False)

    def run(ids: list[int]) -> Callable[[], object]:
        def steps() -> object:
            llm.reset()
            for i, tok in enumerate(llm.generate(ids, top_k=1, temp=0.0, reset=True)):
                yield tok
                if i + 1 == NEW_TOKENS:
                    break

        return steps

    return run


RUNNERS = {"webchat": webchat_runner, "transformers": transformers_runner, "llama.cpp": llamacpp_runner}


def child(engine: str) -> None:
    from webchat.pull import default_gguf_path, ensure_default_model
    from webchat.tokenizer import Tokenizer

    model_dir = ensure_default_model()
    tok = Tokenizer.from_dir(model_dir)
    prompts = {name: tok.encode(tok.apply_chat_template(m)) for name, m in (("short", SHORT), ("long", LONG))}
    run = RUNNERS[engine](model_dir, default_gguf_path())
    time_stream(run(prompts["short"][:8]))  # warm-up
    result: dict[str, object] = {"engine": engine}
    for name, ids in prompts.items():
        ttft, tps = min((time_stream(run(ids)) for _ in range(2)), key=lambda r: r[0])
        result[name] = {"prompt_tokens": len(ids), "ttft_ms": round(ttft, 1), "decode_tps": round(tps, 1)}
    result["peak_rss_mb"] = round(peak_rss_mb())
    print(json.dumps(result))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--engine", choices=ENGINES, help="run one engine (the parent runs each in a child)")
    parser.add_argument("--engines", default=",".join(ENGINES))
    args = parser.parse_args()
    if args.engine:
        child(args.engine)
        return
    rows = []
    for engine in args.engines.split(","):
        proc = subprocess.run([sys.executable, __file__, "--engine", engine], capture_output=True, text=True)
        if proc.returncode:
            print(f"{engine}: failed\n{proc.stderr.strip().splitlines()[-1:]}", file=sys.stderr)
            continue
        rows.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    cols = f"{'prompt':>8}{'TTFT ms':>10}{'decode tok/s':>14}"
    print(f"greedy, {NEW_TOKENS} new tokens, best of 2, torch threads = cores")
    print(f"{'engine':<14}{cols}{cols}{'peak RSS MB':>14}")
    for r in rows:
        s, lg = r["short"], r["long"]
        print(
            f"{r['engine']:<14}{s['prompt_tokens']:>8}{s['ttft_ms']:>10}{s['decode_tps']:>14}"
            f"{lg['prompt_tokens']:>8}{lg['ttft_ms']:>10}{lg['decode_tps']:>14}{r['peak_rss_mb']:>14}"
        )


if __name__ == "__main__":
    main()
