"""What a grammar costs per token (issue 39's target: at most 5% of a one-row step), on the default model, on the
device thread as the server steps it:

  - a one-row greedy decode step, free, against the same step under a JSON schema (llguidance's mask, its
    application to the logits row, the forbidden alternatives marked), alternating A, B, A, B;
  - the mask alone: llguidance's unsafe_compute_mask_ptr per token, timed inside the constrained run;
  - whether computing the mask while the forward runs would pay on this machine: a step with a thread computing a
    mask beside it (the forward uses both cores) against the step alone plus the mask after it.

    .venv/bin/python -m bench.bench_grammar [--model DIR] [--tokens 96] [--rounds 5]
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from pathlib import Path

from bench.common import default_model
from webchat.engine.constraint import empty_mask
from webchat.engine.sequence import GenerationRequest
from webchat.engine.settings import SamplingSettings
from webchat.grammar import build as g
from webchat.grammar import matcher as gm
from webchat.serve.config import ServerConfig
from webchat.serve.device import DeviceThread
from webchat.serve.runtime import Runtime, load_runtime, warm_up

# an answer that runs long without ending (the string's bound is far off): every token is masked
SCHEMA = {"type": "object", "properties": {"title": {"type": "string", "maxLength": 40},
                                           "story": {"type": "string", "maxLength": 4000}},
          "required": ["title", "story"], "additionalProperties": False}


class Timed:
    """A GrammarConstraint whose mask calls are timed."""

    def __init__(self, inner: gm.GrammarConstraint) -> None:
        self.inner, self.spent, self.calls = inner, 0.0, 0

    def mask(self, bits: object) -> bool:
        t = time.perf_counter()
        try:
            return self.inner.mask(bits)  # type: ignore[arg-type]
        finally:
            self.spent += time.perf_counter() - t
            self.calls += 1

    def forced(self) -> list[int]:
        return self.inner.forced()

    def accept(self, token: int) -> None:
        self.inner.accept(token)


def run(rt: Runtime, tokens: int, constrained: bool) -> tuple[float, float]:
    """(ms per decode step, µs of llguidance's mask per token) over `tokens` greedy tokens of one sequence."""
    model, tokenizer, engine = rt.local()
    grammars = gm.grammars_for(tokenizer, model.args.vocab_size)
    c = Timed(grammars.constraint(g.json_schema(SCHEMA))) if constrained else None
    ids = rt.encode_chat([{"role": "user", "content": "Write a long story about a lighthouse, as JSON."}])
    owner = object()
    seq, _ = engine.add(owner, GenerationRequest(prompt_ids=ids, settings=SamplingSettings(temperature=0.0),
                                                 max_new_tokens=tokens + 8, stop_token_ids=[], constraint=c,
                                                 return_probs=True, top_alts=5))
    while seq.prefilling:
        engine.step()
    engine.take(seq)
    for _ in range(4):  # past the opening, where forced tokens come several a step
        engine.step()
    done0, t0 = seq.stats.new_tokens, time.perf_counter()
    spent0, calls0 = (c.spent, c.calls) if c is not None else (0.0, 0)
    for _ in range(tokens):
        engine.step()
    elapsed, made = time.perf_counter() - t0, seq.stats.new_tokens - done0
    seq.cancel.set()
    engine.step()
    engine.close(owner)
    engine.take(seq)
    mask_us = (c.spent - spent0) / max(c.calls - calls0, 1) * 1e6 if c is not None else 0.0
    return elapsed / made * 1000, mask_us


TEXT = ('{"title": "A lighthouse", "story": "Once upon a time there was a lighthouse keeper who lived alone on a rock '
        'in the sea. Every night he climbed the stairs and lit the lamp, and the ships passed safely."}')


def mask_alone(rt: Runtime) -> list[tuple[str, float, float]]:
    """(schema, median µs, p90 µs) of llguidance's mask over each token of TEXT, no forward running: the bench's
    schema (a string bounded at 4000 characters costs the lexer most) and the same with unbounded strings."""
    model, tokenizer, _ = rt.local()
    grammars = gm.grammars_for(tokenizer, model.args.vocab_size)
    loose = {"type": "object", "properties": {"title": {"type": "string"}, "story": {"type": "string"}}}
    out = []
    for name, schema in (("maxLength 4000", SCHEMA), ("unbounded strings", loose)):
        c, bits, times = grammars.constraint(g.json_schema(schema)), empty_mask(model.args.vocab_size), []
        for token in tokenizer.encode_text(TEXT):
            t = time.perf_counter()
            c.mask(bits)
            times.append(time.perf_counter() - t)
            c.accept(token)
        times.sort()
        out.append((name, statistics.median(times) * 1e6, times[int(0.9 * len(times))] * 1e6))
    return out


def overlap(rt: Runtime, steps: int) -> tuple[float, float, float]:
    """(ms a free step, ms a free step with a mask computed on a thread beside it, µs a mask alone)."""
    model, tokenizer, engine = rt.local()
    grammars = gm.grammars_for(tokenizer, model.args.vocab_size)
    c = grammars.constraint(g.json_schema(SCHEMA))
    c.replay(tokenizer.encode_text('{"title": "A lighthouse", "story": "Once'))
    bits = empty_mask(model.args.vocab_size)
    ids = rt.encode_chat([{"role": "user", "content": "Write a long story about a lighthouse."}])
    owner = object()
    seq, _ = engine.add(owner, GenerationRequest(prompt_ids=ids, settings=SamplingSettings(temperature=0.0),
                                                 max_new_tokens=3 * steps + 8, stop_token_ids=[]))
    while seq.prefilling:
        engine.step()
    alone, beside, mask = [], [], []
    for _ in range(steps):
        t = time.perf_counter()
        engine.step()
        alone.append(time.perf_counter() - t)
        worker = threading.Thread(target=c.mask, args=(bits,))
        t = time.perf_counter()
        worker.start()
        engine.step()
        worker.join()
        beside.append(time.perf_counter() - t)
        t = time.perf_counter()
        c.mask(bits)
        mask.append(time.perf_counter() - t)
    seq.cancel.set()
    engine.step()
    engine.close(owner)
    engine.take(seq)
    return statistics.median(alone) * 1000, statistics.median(beside) * 1000, statistics.median(mask) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=None)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    config = ServerConfig(model_dir=args.model or default_model(), device="cpu")
    device = DeviceThread()
    device.start()
    try:
        rt = device.call(lambda: warm_up(load_runtime(config))).result()
        for name, median, p90 in device.call(lambda: mask_alone(rt)).result():
            print(f"llguidance's mask alone, {name}: median {median:.1f} µs, p90 {p90:.1f} µs", flush=True)
        free, masked, masks = [], [], []
        for _ in range(args.rounds):  # A, B, A, B: the machine is shared, its speed drifts
            free.append(device.call(lambda: run(rt, args.tokens, False)).result()[0])
            step, mask_us = device.call(lambda: run(rt, args.tokens, True)).result()
            masked.append(step)
            masks.append(mask_us)
            print(f"round {len(free)}: free {free[-1]:.2f} ms, JSON schema {step:.2f} ms, mask {mask_us:.1f} µs",
                  flush=True)
        a, b, m = statistics.median(free), statistics.median(masked), statistics.median(masks)
        print(f"one-row step, free:            {a:7.2f} ms")
        print(f"one-row step, JSON schema:     {b:7.2f} ms  ({(b - a) / a * 100:+.1f}% the grammar, all of it)")
        print(f"llguidance's mask per token:   {m:7.1f} µs  ({m / 1000 / a * 100:.2f}% of a one-row step)")
        alone, beside, mask = device.call(lambda: overlap(rt, 32)).result()
        print(f"a step alone {alone:.2f} ms; with a mask computed beside it on a thread {beside:.2f} ms; "
              f"the mask after it {mask:.1f} µs (serial: {alone + mask / 1000:.2f} ms)")
    finally:
        device.stop()


if __name__ == "__main__":
    main()
