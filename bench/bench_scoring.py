"""Prompt scores (issue 41): what a request that does not ask for them pays, and what scoring costs.

1. No cost otherwise: one greedy stream through the websocket on the default model, this checkout against another
   checkout's code (`--before DIR`, e.g. `git archive 513b509 | tar -x -C /tmp/before`: main before the scoring
   seam), each a `webchat serve` process of its own, both up, streams alternating (A, B, A, B, ...) so a noisy machine
   drifts both alike. Decode tok/s (the server's own `done.stats.decode_tps`) and time to first chunk, medians.
2. What scoring costs: a prompt of ~370 tokens read with every position scored (/v1/completions, echo, logprobs 5,
   max_tokens 0) against the same prompt read plainly (max_tokens 1, no scores), alternating, on both checkouts (a
   scored prompt's rows run exact whatever the precision since issue 64: the plain read runs the server's own).
3. The same text's prefill in process (`--prefill-only`, no server): its rows flagged exact against the model's own
   precision, alternating, wall and CPU time.
Run: `.venv/bin/python -m bench.bench_scoring --before /tmp/before [--rounds 10] [--tokens 128]
[--serve-args '--speculative none'] [--reads-only]`, or `--prefill-only [--rounds 10]`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
from websockets.sync.client import connect

from bench.common import ROOT, Server, default_model, free_port, table_header, table_row, webchat_server

PROMPT = "Write a long story about a dragon who learns to bake bread."
TEXT = " ".join(["The committee met on Tuesday to discuss the budget for the new library, and after a long debate "
                 "about opening hours, staffing and the children's reading room, it agreed to publish a draft plan "
                 "for comment before the end of the month."] * 8)


def start(src: Path, model: Path, shelf: Path, *extra: str) -> Server:
    """`webchat serve` with `src`'s code and `extra` flags, its models kept in `shelf`, waited for until it answers."""
    return webchat_server(free_port(), model, "--models-dir", str(shelf), *extra, src=src, device=None,
                          name=f"webchat ({src})").wait_ready()


def stream(url: str, tokens: int, stop_ids: list[int]) -> tuple[float, float]:
    """One greedy websocket stream of exactly `tokens` tokens: (decode tok/s of the server, first chunk ms)."""
    with connect(url.replace("http", "ws") + "/ws", max_size=None) as ws:
        json.loads(ws.recv(30))
        t0 = time.perf_counter()
        ws.send(json.dumps({"type": "generate", "id": "b", "messages": [{"role": "user", "content": PROMPT}],
                            "max_new_tokens": tokens, "settings": {"temperature": 0.0, "token_bias": {
                                str(t): -100.0 for t in stop_ids}}}))
        first = 0.0
        while (msg := json.loads(ws.recv(120)))["type"] not in ("done", "error"):
            if msg["type"] == "chunk" and not first:
                first = time.perf_counter() - t0
        if msg["type"] == "error":
            raise RuntimeError(f"the stream failed: {msg}")
        return float(msg["stats"]["decode_tps"]), first * 1000


def read(url: str, model: str, scored: bool, salt: int) -> float:
    """Seconds to read TEXT after a first line of its own (`salt`: no read reuses another's cached prefix): every
    position scored (echo, logprobs 5, max_tokens 0) or plainly (max_tokens 1)."""
    body: dict[str, Any] = {"model": model, "prompt": f"Minutes, item {salt}.\n{TEXT}", "temperature": 0}
    body.update({"echo": True, "logprobs": 5, "max_tokens": 0} if scored else {"max_tokens": 1})
    t0 = time.perf_counter()
    resp = httpx.post(f"{url}/v1/completions", json=body, timeout=300)
    resp.raise_for_status()
    return time.perf_counter() - t0


def compare_streams(servers: dict[str, Server], args: argparse.Namespace, stop_ids: list[int]) -> None:
    """Part 1: one greedy stream a round on each server, alternating."""
    rows: dict[str, list[tuple[float, float]]] = {"before": [], "after": []}
    for _ in range(args.rounds):
        for label, server in servers.items():
            rows[label].append(stream(server.url, args.tokens, stop_ids))
    print(f"\n## One stream without prompt scores, {args.tokens} tokens, greedy (websocket)")
    print(table_header("code", "decode tok/s median", "min / max", "first chunk ms median"))
    for label, runs in rows.items():
        tps = [r[0] for r in runs]
        where = args.before if label == "before" else "this checkout"
        print(table_row(f"{label} ({where})", f"{statistics.median(tps):.1f}",
                        f"{min(tps):.1f} / {max(tps):.1f}", f"{statistics.median(r[1] for r in runs):.0f}"))
    ratio = statistics.median(a[0] / b[0] for a, b in zip(rows["after"], rows["before"], strict=True))
    print(f"\nafter / before, decode tok/s, median of the {args.rounds} pairs: {ratio:.3f}")


def prefill_cost(model_dir: Path, rounds: int, precision: str | None) -> None:
    """Part 3, in process: TEXT's prefill as the engine runs it (CHUNK-row chunks, every row's logits), its rows flagged
    exact (a prompt scored) against unflagged (the model's precision), alternating; wall and CPU time (all threads:
    less moved by other processes than wall time on a shared machine), medians."""
    import torch

    from webchat.kernels.backend import load_model
    from webchat.model.batch import make_batch
    from webchat.model.kv_cache import PageTable
    from webchat.text.tokenizer import Tokenizer

    model = load_model(model_dir, precision=precision)
    ids = Tokenizer.from_dir(model_dir).encode_text(TEXT)
    chunk, page = 256, 16

    def once(exact: bool) -> tuple[float, float]:
        pool = model.new_pool(len(ids) + page, page)
        table = PageTable(pool)
        table.ensure(len(ids))
        w0, c0 = time.perf_counter(), time.process_time()
        with torch.inference_mode():
            for lo in range(0, len(ids), chunk):
                feed = ids[lo:lo + chunk]
                batch = make_batch([(feed, lo, table.pages, list(range(len(feed))))], page, prompt_ends=[len(ids)],
                                   exact=[exact])
                model(batch, pool)
        return time.perf_counter() - w0, time.process_time() - c0

    once(True), once(False)  # warm
    times: dict[bool, list[tuple[float, float]]] = {True: [], False: []}
    for _ in range(rounds):
        for exact in (False, True):
            times[exact].append(once(exact))
    print(f"\n## The prefill of a {len(ids)}-token text in process ({model.precision}, {torch.get_num_threads()} "
          f"threads, {chunk}-row chunks, every row's logits), {rounds} rounds alternating")
    print(table_header("rows", "wall ms median", "CPU ms median"))
    for exact in (False, True):
        label = "flagged exact (a prompt scored)" if exact else f"unflagged ({model.precision})"
        print(table_row(label, f"{statistics.median(t[0] for t in times[exact]) * 1000:.0f}",
                        f"{statistics.median(t[1] for t in times[exact]) * 1000:.0f}"))
    ratio = statistics.median(e[1] / p[1] for e, p in zip(times[True], times[False], strict=True))
    print(f"exact / {model.precision}, CPU time, median of the {rounds} pairs: {ratio:.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", type=Path, default=None, help="another checkout's root (its webchat/ is imported)")
    ap.add_argument("--model", type=Path, default=None)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--serve-args", default="", help="more flags for both servers, e.g. '--speculative none' (the "
                    "scoring cost alone, without what later defaults add)")
    ap.add_argument("--reads-only", action="store_true", help="only part 2 (what scoring costs), on both checkouts")
    ap.add_argument("--prefill-only", action="store_true", help="only part 3 (the scored prefill in process); no "
                    "--before needed")
    ap.add_argument("--precision", choices=["int8", "int8x2"], default=None, help="with --prefill-only: the model's "
                    "precision (default: its default)")
    args = ap.parse_args()
    if args.prefill_only:
        prefill_cost(args.model or default_model(), args.rounds, args.precision)
        return
    from webchat.text.tokenizer import Tokenizer

    if args.before is None:
        ap.error("--before is required (or --prefill-only)")
    model = args.model or default_model()
    stop_ids = Tokenizer.from_dir(model).stop_token_ids
    with tempfile.TemporaryDirectory() as shelf:
        extra = args.serve_args.split()
        servers: dict[str, Server] = {}
        try:
            servers["before"] = start(args.before, model, Path(shelf), *extra)
            servers["after"] = start(ROOT, model, Path(shelf), *extra)
            info = servers["after"].info
            for server in servers.values():
                stream(server.url, 8, stop_ids)  # warm
            print(f"# bench_scoring: {info['model']} ({info['weights']} weights) on {info['device']}; "
                  f"{args.rounds} rounds, streams alternating; serve flags: {args.serve_args or '(defaults)'}")
            if not args.reads_only:
                compare_streams(servers, args, stop_ids)
            n = len(Tokenizer.from_dir(model).encode_text(TEXT))
            times: dict[tuple[str, bool], list[float]] = {}
            salt = 0
            for _ in range(args.rounds):
                for label, server in servers.items():
                    for scored in (False, True):
                        salt += 1
                        times.setdefault((label, scored), []).append(read(server.url, info["model"], scored, salt))
            print(f"\n## Reading a {n}-token text (/v1/completions), the servers and the two reads alternating")
            print(table_header("code", "precision", "plain (max_tokens 1) ms", "scored (echo, logprobs 5) ms",
                               "scored / plain"))
            for label, server in servers.items():
                plain, scored_s = (statistics.median(times[label, s]) for s in (False, True))
                print(table_row(label, server.info.get("precision", "?"), f"{plain * 1000:.0f}",
                                f"{scored_s * 1000:.0f}", f"{scored_s / plain:.2f}"))
        finally:
            for server in servers.values():
                server.stop()

if __name__ == "__main__":
    main()
