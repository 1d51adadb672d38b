"""Per-step work outside the forward (batch building, sampling, detokenising, events) against the forward itself, on
the default model, as the server's device thread runs it: engine.step() for 1 and 4 greedy decoding sequences, with
and without 5 alternatives per token, and with a token bias (an API client's logit_bias). Issue 20's target:
outside-forward time at most 10% of a one-row step.

Then whether the forward's matmuls wait on memory: the C++ matmul called on each of the model's quantized matrices in
turn, one row of x (every matrix read from memory once, as a token reads them), against the same calls each repeated
on a matrix already in cache. On the 2-vCPU Xeon, default model, ac8baec and c2a735d's prefetch (qcommon.h
prefetch_ahead) alternating: 8.89 / 5.64 ms before, 5.67 / 5.44 ms after.

    .venv/bin/python -m bench.bench_step [--model DIR] [--steps 64]
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from pathlib import Path

import torch

from bench.common import default_model, table_header, table_row
from webchat.engine.sequence import GenerationRequest
from webchat.engine.settings import SamplingSettings
from webchat.model.transformer import Transformer
from webchat.serve.config import ServerConfig
from webchat.serve.device import DeviceThread
from webchat.serve.runtime import Runtime, load_runtime, warm_up


def measure(rt: Runtime, rows: int, alts: int, steps: int, bias: bool = False) -> tuple[float, float]:
    """(ms per step, ms of it in the model's forward) over `steps` decode steps of `rows` sequences; `bias`: each with
    a token bias (an API client's logit_bias, as bench_served sends to keep end-of-turn away)."""
    engine = rt.engine
    spent = [0.0]
    forward = Transformer.forward

    def timed(self: Transformer, *args: object, **kwargs: object) -> torch.Tensor:
        t = time.perf_counter()
        try:
            return forward(self, *args, **kwargs)  # type: ignore[arg-type]
        finally:
            spent[0] += time.perf_counter() - t

    owners = [object() for _ in range(rows)]
    seqs = []
    for i, owner in enumerate(owners):
        ids = rt.encode_chat([{"role": "user", "content": f"Story {i}: write a long story about a lighthouse."}])
        req = GenerationRequest(prompt_ids=ids, settings=SamplingSettings(temperature=0.0,
                                                                          token_bias={2: -100.0} if bias else {}),
                                max_new_tokens=steps + 64, stop_token_ids=[], return_probs=alts > 0, top_alts=alts)
        seqs.append(engine.add(owner, req)[0])
    while any(s.prefilling for s in seqs):
        engine.step()
    for s in seqs:
        engine.take(s)
    Transformer.forward = timed  # type: ignore[method-assign]
    try:
        t0 = time.perf_counter()
        for _ in range(steps):
            engine.step()
            for s in seqs:
                engine.take(s)
        total = time.perf_counter() - t0
    finally:
        Transformer.forward = forward  # type: ignore[method-assign]
    for owner in owners:
        engine.close(owner)
    engine.reset()
    return total * 1000 / steps, spent[0] * 1000 / steps


def streamed_vs_cached(rt: Runtime, repeats: int = 20) -> tuple[float, float]:
    """(ms for one call on each quantized matrix in turn, ms for the same calls each on a matrix already in cache)."""
    from webchat.gguf.blocks import QTYPES
    from webchat.kernels.cpu import build
    from webchat.model.quant import QLinear

    kernels, model = build.load(), rt.model
    assert model is not None, "a local model"
    calls = [(torch.randn(1, m.in_features), m.weight, QTYPES[m.qtype][0], m.in_features)
             for m in model.modules() if isinstance(m, QLinear) and m.qtype in QTYPES]

    def one_pass() -> float:
        t = time.perf_counter()
        for x, w, qtype, k in calls:
            kernels.qmatmul(x, w, qtype, k, None)
        return time.perf_counter() - t

    one_pass()
    streamed = statistics.median(one_pass() for _ in range(repeats))
    cached = 0.0
    for x, w, qtype, k in calls:
        for _ in range(3):
            kernels.qmatmul(x, w, qtype, k, None)
        t = time.perf_counter()
        for _ in range(repeats):
            kernels.qmatmul(x, w, qtype, k, None)
        cached += (time.perf_counter() - t) / repeats
    return streamed * 1000, cached * 1000


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=None, help="model folder (default: the pulled default model)")
    ap.add_argument("--steps", type=int, default=64)
    args = ap.parse_args()
    args.model = args.model or default_model()
    device = DeviceThread()  # where the server steps it: one OpenMP team, warmed up
    device.start()
    rt = device.call(lambda: warm_up(load_runtime(ServerConfig(model_dir=args.model, device="cpu")))).result()
    print(f"{args.model.name}, {torch.get_num_threads()} threads, {args.steps} decode steps each")
    print(table_header("rows", "alternatives", "bias", "step ms", "forward ms", "outside", align="rrlrrr"))
    for rows, alts, bias in ((1, 0, False), (1, 5, False), (1, 0, True), (4, 0, False), (4, 5, False), (4, 0, True)):
        step, fwd = device.call(lambda r=rows, a=alts, b=bias: measure(rt, r, a, args.steps, b)).result()
        print(table_row(rows, alts, "yes" if bias else "no", f"{step:.2f}", f"{fwd:.2f}",
                        f"{(step - fwd) / step * 100:.1f}%"), flush=True)
    streamed, cached = device.call(functools.partial(streamed_vs_cached, rt)).result()
    print(f"the quantized matrices, one row of x: {streamed:.2f} ms called in turn (from memory), {cached:.2f} ms "
          f"each in cache")
    device.stop()


if __name__ == "__main__":
    main()
