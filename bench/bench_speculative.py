"""Decode tokens/s without speculation, with self-draft, n-gram lookup and auto, on two tasks, side by side.

    .venv/bin/python bench/bench_speculative.py [--model DIR] [--max-new-tokens 128] [--self-layers 7 20]

Greedy, so every mode must print the same tokens (checked: the `same` column). Tasks: (a) an open chat question,
(b) a task that repeats its input (fix a typo in a paragraph), where n-gram lookup has something to find.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from webchat.engine.generator import Generator
from webchat.engine.sequence import GenerationRequest
from webchat.engine.settings import SamplingSettings

PARAGRAPH = ("The old lighthouse stood at the edge of the cliff for more than a century. Every night its keeper "
             "climbed the narrow stairs, cleaned the great lens and lit the lamp, so that ships could find their "
             "way past the rocks. Sailors said that the light had saved hundreds of lives, and the villlage was "
             "proud of it.")
TASKS = {
    "open question": "What are three good habits for staying healthy while working from home? Explain each briefly.",
    "fix the typo": f"Fix the typo in this paragraph and write the whole corrected paragraph:\n\n{PARAGRAPH}",
}


@dataclass
class Row:
    task: str
    mode: str
    tokens: int
    tps: float
    ttft_ms: float
    drafted: int
    accepted: int
    same: bool


def run_once(gen: Generator, ids: list[int], mode: str, max_new: int) -> tuple[list[int], Any, float]:
    gen.engine.reset()  # a cold start: no pages or cached prefixes from the last run
    gen.begin_stream(GenerationRequest(prompt_ids=ids, settings=SamplingSettings(temperature=0.0),
                                       max_new_tokens=max_new, speculative=mode))
    out: list[int] = []
    while True:
        res = gen.stream()
        out += res.token_ids
        if res.eos:
            return out, res.stats, res.stats.decode_tps if res.stats else 0.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", type=Path, default=None)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--self-layers", type=int, nargs="+", default=[7, 20])
    args = ap.parse_args()

    from webchat.model.loader import load_model
    from webchat.pull import ensure_default_model
    from webchat.text.tokenizer import Tokenizer

    path = args.model or ensure_default_model()
    model, tok = load_model(path), Tokenizer.from_dir(path)
    print(f"model {path.name}: {model.args.n_layers} layers; torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads; greedy, max {args.max_new_tokens} new tokens")
    modes = [("none", None), *[(f"self L={n}", n) for n in args.self_layers], ("ngram", None), ("auto", None)]
    rows: list[Row] = []
    for task, text in TASKS.items():
        ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": text}]))
        reference: list[int] | None = None
        for label, layers in modes:
            gen = Generator(model, tok, max_seq_len=len(ids) + args.max_new_tokens + 8, self_draft_layers=layers)
            mode = label.split()[0]
            run_once(gen, ids[:16], mode, 4)  # warm-up (auto: its cost curve measured here)
            out, stats, tps = run_once(gen, ids, mode, args.max_new_tokens)
            reference = out if reference is None else reference
            rows.append(Row(task, label, len(out), tps, stats.ttft_ms, stats.drafted, stats.accepted,
                            out == reference))
    print(f"\n{'task':<14} {'mode':<11} {'tokens':>6} {'tok/s':>7} {'vs none':>7} {'ttft ms':>8} "
          f"{'drafted':>7} {'accepted':>8} {'accept%':>7} {'same':>5}")
    base = {r.task: r.tps for r in rows if r.mode == "none"}
    for r in rows:
        rate = f"{100 * r.accepted / r.drafted:.0f}%" if r.drafted else "-"
        print(f"{r.task:<14} {r.mode:<11} {r.tokens:>6} {r.tps:>7.1f} {r.tps / base[r.task]:>6.2f}x "
              f"{r.ttft_ms:>8.0f} {r.drafted:>7} {r.accepted:>8} {rate:>7} {str(r.same):>5}")


if __name__ == "__main__":
    main()
