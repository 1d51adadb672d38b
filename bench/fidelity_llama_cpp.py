"""Issue 38's fidelity measure: webchat in each precision and llama.cpp's llama-server, on the same K-quant GGUF,
against a float32 reference on the weights dequantized from that file.

    bash bench/make_bench_files.sh                        # once: smollm2-135m-q4_k_m.gguf (llama-quantize's Q4_K_M)
    .venv/bin/python -m bench.fidelity_llama_cpp          # [--gguf FILE] [--tokens 32] [--src CHECKOUT]

The reference is transformers in float32 on the file itself (`from_pretrained(gguf_file=...)`: gguf-py dequantizes
every tensor; none of webchat's code), its greedy tokens and each step's probabilities (softmax of the raw logits, in
float64). Each side runs as a user runs it, served on the same file one at a time: `webchat serve --exact` (float32
activations), `webchat serve` (its default: int8 activations where issue 38's choice picked them for this file), and
llama-server with its defaults (2 threads, f16 KV cache). Every side gets the same prompt ids (webchat's chat
template: what its chat endpoint runs on; llama-server gets them as ids) and the end-of-turn tokens banned (webchat:
logit_bias -100; llama-server: ignore_eos; the reference: -inf), so each prompt gives `--tokens` tokens to compare.
Printed per side over the 8 held-out chat prompts (none of them in tests/model/test_fidelity.py): how many greedy
continuations equal the reference token for token, how many texts are equal, the first divergence per prompt, and the
largest |p - p_ref| over the tokens in both top-5 lists at the first generated token and over the agreed prefix (every
step whose context both share: up to and including the first divergence).

`--more N` asks N further held-out prompts (bench/served_prompts.py's open questions) after the 8 and prints a second
table over all of them: with 8 prompts one near-tie flipped by a rounding moves a side's count by one (the AVX2 class
went 3/8 -> 2/8 when a prompt's Q8_0 rows changed summation order, nothing else changed), so beside the counts it
gives the mean number of greedy tokens each side keeps before its first divergence, and the first token's |Δp| as a
median and a maximum over the prompts.

A checkout without `serve --exact` (before issue 38's precision choice lands) runs its one default server, whose
activations are float32, and says the int8 side is absent.
"""

from __future__ import annotations

import argparse
import io
import math
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import torch

from bench.common import (
    ROOT,
    THREADS,
    Server,
    find_llama_server,
    free_port,
    llama_server,
    table_header,
    table_row,
    webchat_server,
)
from bench.served_files import bench_files_dir, has_exact_flag, precision_of
from bench.served_prompts import ASKS, SUBJECTS, open_chat

TOP = 5
PROMPTS = [  # held out: none is a prompt of tests/model/test_fidelity.py
    [{"role": "user", "content": "Give me three tips for keeping houseplants alive."}],
    [{"role": "system", "content": "You answer in one short paragraph."}, {"role": "user", "content": "Why is the sky "
                                                                                                      "blue?"}],
    [{"role": "user", "content": "Write a haiku about autumn rain."}],
    [{"role": "user", "content": "What is 17 multiplied by 23? Show your steps."}],
    [{"role": "user", "content": "Summarise the plot of Romeo and Juliet in two sentences."}],
    [{"role": "user", "content": "Écris une phrase en français sur la mer. 🌊"}],
    [{"role": "user", "content": "Write a SQL query that counts the orders of each customer."}],
    [{"role": "user", "content": "What should I pack for a weekend hiking trip? 🏕️"}],
]


@dataclass
class Run:
    tokens: list[int]
    tops: list[dict[int, float] | None]  # per step: top-5 id -> p (None: the side gave none for that step)


@dataclass
class Agreement:
    first_div: int | None  # first token that differs from the reference's; None: all equal
    text_equal: bool
    dp_first: float | None  # largest |Δp| over the ids in both top-5 lists at the first token
    dp_prefix: float | None  # the same over the agreed prefix


def reference_runs(gguf: Path, prompts: list[list[int]], banned: list[int], n: int) -> tuple[list[Run], Any]:
    """transformers float32 on the GGUF's dequantized weights: greedy (banned ids at -inf), top-5 of the raw softmax."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                                              dtype=torch.float32).eval()
    runs = []
    with torch.no_grad():
        for ids in prompts:
            run = Run([], [])
            for _ in range(n):  # the whole sequence each step: no cache API to depend on, 32 short forwards
                logits = model(input_ids=torch.tensor([ids + run.tokens]), use_cache=False).logits[0, -1].double()
                top = torch.topk(torch.softmax(logits, -1), TOP)
                run.tops.append({int(i): float(p) for p, i in zip(top.values, top.indices, strict=True)})
                run.tokens.append(int(logits.index_fill(0, torch.tensor(banned), -math.inf).argmax()))
            runs.append(run)
    return runs, model


def webchat_runs(server: Server, prompts: list[list[dict[str, str]]], lengths: list[int], banned: list[int],
                 n: int) -> list[Run]:
    """Greedy chat completions with top-5 logprobs and token ids from a webchat server."""
    client = httpx.Client(base_url=f"http://127.0.0.1:{server.port}", timeout=600)
    runs = []
    for messages, length in zip(prompts, lengths, strict=True):
        body = {"model": server.model, "messages": messages, "max_tokens": n, "temperature": 0, "logprobs": True,
                "top_logprobs": TOP, "return_token_ids": True, "logit_bias": {str(t): -100 for t in banned}}
        answer = client.post("/v1/chat/completions", json=body).raise_for_status().json()
        if answer["usage"]["prompt_tokens"] != length:
            raise RuntimeError(f"{server.name} ran a {answer['usage']['prompt_tokens']}-token prompt, expected the "
                               f"{length} tokens of the same chat template")
        entries = answer["choices"][0]["logprobs"]["content"]
        tops: list[dict[int, float] | None] = [{a["id"]: math.exp(a["logprob"]) for a in e["top_logprobs"]}
                                               for e in entries]
        runs.append(Run([int(t) for t in answer["choices"][0]["token_ids"]], tops))
    return runs


def llama_runs(server: Server, prompts: list[list[int]], n: int) -> list[Run]:
    """Greedy /completion on the prompt ids, end of generation ignored, top-5 of the raw softmax per token."""
    client = httpx.Client(base_url=f"http://127.0.0.1:{server.port}", timeout=600)
    runs = []
    for ids in prompts:
        body = {"prompt": ids, "n_predict": n, "temperature": 0, "n_probs": TOP, "return_tokens": True,
                "ignore_eos": True, "cache_prompt": False}
        answer = client.post("/completion", json=body).raise_for_status().json()
        tokens = [int(t) for t in answer["tokens"]]
        tops: list[dict[int, float] | None] = [None] * len(tokens)
        step = 0
        for entry in answer["completion_probabilities"]:  # one per token; matched by id in case two come as one
            while step < len(tokens) and tokens[step] != entry["id"]:
                step += 1
            if step < len(tokens):
                tops[step] = {a["id"]: math.exp(a["logprob"]) for a in entry["top_logprobs"]}
                step += 1
        runs.append(Run(tokens, tops))
    return runs


def max_dp(ref: dict[int, float] | None, got: dict[int, float] | None) -> float | None:
    if ref is None or got is None:
        return None
    common = [abs(got[i] - p) for i, p in ref.items() if i in got]
    return max(common) if common else None


def agree(ref: Run, got: Run, decode: Any) -> Agreement:
    first = next((i for i, (a, b) in enumerate(zip(ref.tokens, got.tokens, strict=False)) if a != b), None)
    if first is None and len(got.tokens) != len(ref.tokens):
        first = min(len(got.tokens), len(ref.tokens))
    shared = len(ref.tokens) if first is None else min(first + 1, len(got.tokens))
    dps = [d for i in range(shared) if (d := max_dp(ref.tops[i], got.tops[i])) is not None]
    return Agreement(first, decode(got.tokens) == decode(ref.tokens), max_dp(ref.tops[0], got.tops[0]) if got.tops
                     else None, max(dps) if dps else None)


def fmt(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.1e}"


def row(name: str, precision: str, marks: list[Agreement]) -> str:
    firsts = ", ".join("=" if a.first_div is None else str(a.first_div) for a in marks)
    dp_first = max((a.dp_first for a in marks if a.dp_first is not None), default=None)
    dp_prefix = max((a.dp_prefix for a in marks if a.dp_prefix is not None), default=None)
    tokens_equal, texts_equal = sum(a.first_div is None for a in marks), sum(a.text_equal for a in marks)
    return table_row(name, precision, f"{tokens_equal}/{len(marks)}", f"{texts_equal}/{len(marks)}", firsts,
                     fmt(dp_first), fmt(dp_prefix))


def wide_row(name: str, precision: str, marks: list[Agreement], tokens: int) -> str:
    """Over many prompts: greedy equal, the mean tokens kept before the first divergence, the first token's |Δp|
    median and max, the agreed prefixes' largest."""
    kept = statistics.mean(tokens if a.first_div is None else a.first_div for a in marks)
    firsts = [a.dp_first for a in marks if a.dp_first is not None]
    prefix = max((a.dp_prefix for a in marks if a.dp_prefix is not None), default=None)
    median = statistics.median(firsts) if firsts else None
    return table_row(name, precision, f"{sum(a.first_div is None for a in marks)}/{len(marks)}", f"{kept:.1f}",
                     f"{fmt(median)} / {fmt(max(firsts, default=None))}", fmt(prefix))


def weight_check(model: Any, folder: Path) -> str:
    """The reference's weights (gguf-py's dequantization) against webchat's converter's model.safetensors."""
    from safetensors.torch import load_file

    ours = load_file(str(folder / "model.safetensors"))
    theirs = model.state_dict()
    common = [k for k in ours if k in theirs]
    worst = max(float((ours[k] - theirs[k]).abs().max()) for k in common)
    return f"{len(common)} tensors, max |Δw| {worst:.1e}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gguf", type=Path, default=bench_files_dir() / "smollm2-135m-q4_k_m.gguf")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--llama-server", type=Path, default=None)
    ap.add_argument("--src", type=Path, default=ROOT, help="the webchat checkout to serve from")
    open_questions = len(ASKS) * len(SUBJECTS)  # open_chat(i) repeats itself past these
    ap.add_argument("--more", type=int, default=0,
                    help=f"further held-out prompts for a second, wider table (0 to {open_questions})")
    args = ap.parse_args()
    if not 0 <= args.more <= open_questions:
        raise SystemExit(f"--more must be 0 to {open_questions} (the distinct open questions), got {args.more}")
    from webchat.files.gguf_cache import model_folder
    from webchat.text.tokenizer import Tokenizer

    gguf, src = args.gguf.expanduser().resolve(), args.src.resolve()
    if not gguf.exists():
        raise SystemExit(f"{gguf} does not exist: write it with `bash bench/make_bench_files.sh`")
    folder = model_folder(gguf, out=io.StringIO())
    tok = Tokenizer.from_dir(folder)
    prompts = PROMPTS + [open_chat(i) for i in range(args.more)]
    ids = [tok.encode_chat(m) for m in prompts]
    banned = tok.stop_token_ids
    print(f"{gguf.name}: {len(PROMPTS)} chat prompts (and {args.more} more), {args.tokens} greedy tokens (end of turn "
          f"banned: {banned}), against transformers float32 on the file's dequantized weights", flush=True)
    ref, model = reference_runs(gguf, ids, banned, args.tokens)
    print(f"reference weights (gguf-py) against webchat's converter: {weight_check(model, folder)}", flush=True)
    del model
    exact_flag = has_exact_flag(src)
    sides = [True, False] if exact_flag else [False]  # exact?
    if not exact_flag:
        print(f"note: `webchat serve` in {src} has no --exact (issue 38's precision choice has not landed): its one "
              "default server runs float32 activations (exact); the int8 side is absent", flush=True)
    rows, wide = [], []
    n = len(PROMPTS)
    for exact in sides:  # one at a time: each starts when the last has stopped
        server = webchat_server(free_port(), gguf, src=src, exact=exact)
        name = server.name
        try:
            server.wait_ready()
            runs = webchat_runs(server, prompts, [len(i) for i in ids], banned, args.tokens)
        finally:
            server.stop()
        precision = precision_of(server.info)
        if name == "webchat" and exact_flag and server.info.get("precision") != "int8":  # the label adds kernels
            print(f"note: webchat's default precision for {gguf.name} is {precision!r}: the int8 side is absent")
        marks = [agree(r, g, tok.decode) for r, g in zip(ref, runs, strict=True)]
        rows.append(row(name, precision, marks[:n]))
        wide.append(wide_row(name, precision, marks, args.tokens))
    binary = find_llama_server(args.llama_server)
    server = llama_server(binary, gguf, free_port(), 4096, 1)
    try:
        server.wait_ready()
        runs = llama_runs(server, ids, args.tokens)
    finally:
        server.stop()
    marks = [agree(r, g, tok.decode) for r, g in zip(ref, runs, strict=True)]
    rows.append(row("llama-server", f"its own ({THREADS} threads)", marks[:n]))
    wide.append(wide_row("llama-server", f"its own ({THREADS} threads)", marks, args.tokens))
    print("\n" + table_header("side", "precision", f"greedy {args.tokens} tokens = reference", "text = reference",
                              "first divergence per prompt (token; = none)", "top-5 max |Δp|, first token",
                              "top-5 max |Δp|, agreed prefix", align="llrrlrr"))
    print("\n".join(rows))
    if args.more:
        print(f"\nall {len(prompts)} prompts (the 8 and {args.more} open questions):\n")
        print(table_header("side", "precision", f"greedy {args.tokens} tokens = reference",
                           "mean tokens before the first divergence", "top-5 max |Δp|, first token: median / max",
                           "top-5 max |Δp|, agreed prefix", align="llrrrr"))
        print("\n".join(wide))


if __name__ == "__main__":
    main()
