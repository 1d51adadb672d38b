"""Auto speculation against none in one process, several streams at once: decode tok/s, and what the planning cost.

    .venv/bin/python -m bench.bench_auto_planning --set open --clients 4 --rounds 10
    .venv/bin/python -m bench.bench_auto_planning --set copy --clients 4 --rounds 10 --src /tmp/base   # another build

The served benchmark (bench_served --speculation --spec-paired) moves by several percent between runs; this one
runs the engine alone, so the planner's own cost shows. The engine-wide suffix index first holds the replies to
--fill other prompts of the set (auto, as a served engine's does after a while); then each round's `--clients`
prompts run as concurrent greedy streams under none and under auto, the order alternating, and the none side's
replies are kept out of the index (otherwise auto would copy the reply none just gave to the same prompt). The fill's
prompts and the rounds' are disjoint. Printed: decode tok/s of each (after the prompts' prefill: the same on both
sides), auto / none, the time in Engine._plan_drafts per second of decoding, offers looked at against offers sat out,
and tokens drafted / accepted; then the rounds' decode steps by mode and kind (with draft rows or without, at the full
batch): their count, ms a step, of it the forward's, and tokens a step. The ratio moves by 1-2% between runs of the
same build; the steps without drafts, auto's against none's, show what the planning costs a step with less noise.
`--src DIR` runs this bench as the checkout DIR has it, on DIR's webchat (`python -m` from inside DIR).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from bench.common import default_model, table_header, table_row
from bench.served_prompts import SETS
from webchat.engine.engine import Engine
from webchat.engine.generator import Generator
from webchat.engine.sequence import GenerationRequest
from webchat.engine.settings import SamplingSettings
from webchat.engine.spec import planner as adaptive
from webchat.kernels.backend import load_model
from webchat.text.tokenizer import Tokenizer


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--set", default="open", choices=sorted(SETS))
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--fill", type=int, default=48, help="replies in the engine-wide index before the rounds")
    p.add_argument("--src", type=Path, help="another checkout's root: run this bench as it has it, on its webchat")
    args = p.parse_args()
    if args.src and "BENCH_SRC" not in os.environ:  # once: the run in DIR has BENCH_SRC set
        src = str(args.src.resolve())
        os.chdir(src)  # `python -m` puts the working directory first: DIR's bench and DIR's webchat
        os.execve(sys.executable, [sys.executable, "-m", "bench.bench_auto_planning", *sys.argv[1:]],
                  dict(os.environ, PYTHONPATH=src, BENCH_SRC=src))

    path = default_model()
    model, tok = load_model(path), Tokenizer.from_dir(path)
    eng = Engine(model, tok, max_seq_len=2048, pool_tokens=16384)
    eng.calibrate()
    max_new = 96 if args.set == "open" else 320
    plan_s = [0.0]
    looked = {"offers": 0, "sat out": 0}
    plan_drafts, offer, remember = Engine._plan_drafts, adaptive.SeqDrafter.offer, adaptive.AutoSpec.remember

    def timed_plan(self: Engine, rows: list) -> None:  # type: ignore[type-arg]
        t = time.perf_counter()
        plan_drafts(self, rows)
        plan_s[0] += time.perf_counter() - t

    def counted_offer(self: adaptive.SeqDrafter, *a: object, **k: object) -> adaptive.Proposal | None:
        looked["sat out" if self.rest > 0 else "offers"] += 1
        return offer(self, *a, **k)  # type: ignore[arg-type]

    Engine._plan_drafts = timed_plan  # type: ignore[method-assign]
    adaptive.SeqDrafter.offer = counted_offer  # type: ignore[method-assign]
    kinds: dict[tuple[str, str], list[float]] = {}  # (mode, kind) -> [steps, s, forward s, tokens]
    measuring, forward_s, forward_rows = [False], [0.0], [0]
    model_forward = model.forward

    def timed_forward(batch: object, *a: object, **k: object) -> object:
        t = time.perf_counter()
        try:
            return model_forward(batch, *a, **k)  # type: ignore[arg-type]
        finally:
            forward_s[0] += time.perf_counter() - t
            forward_rows[0] = batch.num_tokens  # type: ignore[attr-defined]

    model.forward = timed_forward  # type: ignore[method-assign]

    def step(mode: str) -> None:
        seqs = list(eng.running)
        if not measuring[0] or len(seqs) < args.clients:
            eng.step()
            return
        forward_s[0], before = 0.0, sum(len(s.tokens) for s in seqs)
        t = time.perf_counter()
        eng.step()
        took = time.perf_counter() - t
        kind = "with" if forward_rows[0] > len(seqs) else "without"
        k = kinds.setdefault((mode, kind), [0, 0.0, 0.0, 0])
        k[0] += 1
        k[1] += took
        k[2] += forward_s[0]
        k[3] += sum(len(s.tokens) for s in seqs) - before

    def run(chats: list[list[dict[str, str]]], mode: str) -> tuple[int, float]:
        gens = [Generator(model, tok, engine=eng) for _ in chats]
        for g, chat in zip(gens, chats, strict=True):
            ids = tok.encode(tok.apply_chat_template(chat))
            g.begin_stream(GenerationRequest(prompt_ids=ids, settings=SamplingSettings(temperature=0.0),
                                             max_new_tokens=max_new, speculative=mode))
        while any(s.prefilling for s in eng.running):
            eng.step()
        t = time.perf_counter()
        while eng.running:
            step(mode)
        seconds = time.perf_counter() - t
        tokens = 0
        for g in gens:
            seq = g._seq
            assert seq is not None
            while (r := eng.take(seq)) is not None:
                tokens += len(r.token_ids)
                if r.eos:
                    break
        return tokens, seconds

    for i in range(0, args.fill, args.clients):
        run([SETS[args.set](i + c) for c in range(args.clients)], "auto")
    totals = {"none": [0, 0.0], "auto": [0, 0.0]}
    plan_s[0] = 0.0
    measuring[0] = True
    looked.update(dict.fromkeys(looked, 0))
    drafted0, accepted0 = sum(eng.auto.counts.drafted.values()), sum(eng.auto.counts.accepted.values())
    for r in range(args.rounds):
        chats = [SETS[args.set](args.fill + r * args.clients + c) for c in range(args.clients)]
        for mode in ("none", "auto") if r % 2 == 0 else ("auto", "none"):
            adaptive.AutoSpec.remember = remember if mode == "auto" else (lambda self, output: None)  # type: ignore
            n, s = run(chats, mode)
            totals[mode][0] += n
            totals[mode][1] += s
    adaptive.AutoSpec.remember = remember  # type: ignore[method-assign]
    tps = {m: n / s for m, (n, s) in totals.items()}
    drafted = sum(eng.auto.counts.drafted.values()) - drafted0
    accepted = sum(eng.auto.counts.accepted.values()) - accepted0
    print(f"{args.set}, {args.clients} streams, {args.rounds} rounds: none {tps['none']:.1f} tok/s, auto "
          f"{tps['auto']:.1f} ({tps['auto'] / tps['none']:.3f}x); planning {1000 * plan_s[0] / totals['auto'][1]:.1f} "
          f"ms a second of decoding; offers looked at {looked['offers']}, sat out {looked['sat out']}; drafted "
          f"{drafted}, accepted {accepted}")
    print(f"\nthe rounds' decode steps of all {args.clients} streams, by mode and kind")
    print(table_header("mode", "steps", "count", "ms a step", "of it the forward", "the rest", "tokens a step",
                       align="llrrrrr"))
    for (mode, kind), (n, secs, fwd, tokens) in sorted(kinds.items()):
        print(table_row(mode, f"{kind} drafts", f"{n:.0f}", f"{1000 * secs / n:.3f}", f"{1000 * fwd / n:.3f}",
                        f"{1000 * (secs - fwd) / n:.3f}", f"{tokens / n:.2f}"))


if __name__ == "__main__":
    main()
