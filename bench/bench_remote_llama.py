"""webchat in front of llama.cpp's `llama-server` (`webchat serve --engine-url`): does the page's heatmap fill, does
Stop reach the upstream, does a branch continue from the chosen token, and what does the hop cost in throughput?

Both are real processes on loopback, on the same GGUF (the default model's Q4_1 unless --gguf). Printed:
- heatmap: of one greedy reply through webchat's websocket, how many tokens carry p, a rank and alternatives;
- branch: a reply continued (`continue: true`) from the 2nd alternative of its 4th token starts where it should, sent
  as text and as token ids (`prefix_ids`: /apply-template's prompt text and the ids, one mixed prompt);
- Stop: after 5 chunks, `stop` on webchat's websocket → llama-server's /slots shows no slot processing (polled every
  2 ms), and the same for a client that closes llama-server's own stream (the baseline), median over --trials;
- throughput: 1 and 16 concurrent OpenAI streams (greedy, 96 tokens, end-of-turn biased away) straight to
  llama-server and through webchat's /v1, alternating for --rounds; best aggregate tok/s of each and the ratio.

    .venv/bin/python -m bench.bench_remote_llama [--rounds 2] [--trials 10] [--threads 2] [--gguf FILE]
                                                 [--llama-server BIN]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import httpx
from websockets.sync.client import connect

from bench.common import (
    ROOT,
    THREADS,
    Server,
    concurrent,
    default_gguf,
    find_llama_server,
    free_port,
    llama_server,
    stop_token_ids,
    table_header,
    table_row,
    webchat_server,
)


def front_server(upstream_port: int, port: int, stops: list[int]) -> Server:
    return webchat_server(port, None, "--engine-url", f"http://127.0.0.1:{upstream_port}", "--max-sessions", "16",
                          stops=stops, device=None, name="webchat→llama-server")


def ws_generate(port: int, body: dict[str, object]) -> tuple[dict[str, object], list[dict[str, object]], str]:
    """One websocket request to the end: (hello, token entries, text)."""
    with connect(f"ws://127.0.0.1:{port}/ws", open_timeout=30) as ws:
        hello = json.loads(ws.recv(30))
        ws.send(json.dumps({"type": "generate", "id": "g", **body}))
        tokens: list[dict[str, object]] = []
        text = ""
        while True:
            msg = json.loads(ws.recv(120))
            if msg["type"] == "chunk":
                text += msg.get("text", "")
                tokens += msg.get("tokens", [])
            elif msg["type"] == "done":
                return hello, tokens, text
            elif msg["type"] == "error":
                raise RuntimeError(f"webchat answered an error: {msg}")


def heatmap_and_branch(port: int) -> None:
    question = [{"role": "user", "content": "Name three rivers in Europe and say one thing about each."}]
    hello, tokens, text = ws_generate(port, {"messages": question, "max_new_tokens": 48, "alternatives": 5,
                                             "settings": {"temperature": 0}})
    engine = hello.get("engine") or {}
    with_p = sum(1 for t in tokens if t.get("p") is not None)
    with_rank = sum(1 for t in tokens if t.get("rank") is not None)
    with_alts = sum(1 for t in tokens if t.get("top"))
    print(f"upstream: {engine.get('kind')} {engine.get('model')}, probabilities {engine.get('probabilities')}, "
          f"bytes {engine.get('bytes')}, token ids {engine.get('token_ids')}, continue {engine.get('continue_final')}, "
          f"top_logprobs ≤ {engine.get('max_top_logprobs')}")
    print(f"heatmap: {len(tokens)} tokens; with p {with_p}, with rank {with_rank}, with alternatives {with_alts}")
    if len(tokens) > 3 and len(tokens[3].get("top") or []) > 1:  # type: ignore[arg-type]
        alt = tokens[3]["top"][1]  # type: ignore[index]
        prefix = "".join(str(t.get("text", "")) for t in tokens[:3]) + str(alt["text"])
        partial = [*question, {"role": "assistant", "content": prefix}]
        _, more, cont = ws_generate(port, {"messages": partial, "max_new_tokens": 24, "alternatives": 5,
                                           "continue": True, "settings": {"temperature": 0}})
        print(f"branch: from token 4's alternative {alt['text']!r}: prefix {prefix!r} + continuation {cont[:60]!r} "
              f"({len(more)} tokens, with p {sum(1 for t in more if t.get('p') is not None)})")
        assert more and not cont.startswith(prefix), "the continuation repeats the prefix"
        ids = [t.get("id", -1) for t in tokens[:3]] + [alt.get("id", -1)]
        if all(isinstance(i, int) and i >= 0 for i in ids):  # the page's prefix_ids: the tokens as they were
            _, by_ids, cont_ids = ws_generate(port, {"messages": partial, "max_new_tokens": 24, "alternatives": 5,
                                                     "continue": True, "prefix_ids": ids,
                                                     "settings": {"temperature": 0}})
            print(f"branch as token ids {ids} ({engine.get('token_prompt')}): continuation {cont_ids[:60]!r} "
                  f"({len(by_ids)} tokens, with p {sum(1 for t in by_ids if t.get('p') is not None)}); "
                  f"{'the same as' if cont_ids == cont else 'differs from'} the branch sent as text")
        else:
            print(f"branch as token ids: not possible, the upstream gave ids {ids}")
    print(f"greedy reply: {text[:100]!r}")


def processing(upstream_port: int) -> int:
    slots = httpx.get(f"http://127.0.0.1:{upstream_port}/slots", timeout=5).json()
    return sum(1 for s in slots if s.get("is_processing"))


def stop_trial(front_port: int, upstream_port: int) -> float:
    with connect(f"ws://127.0.0.1:{front_port}/ws") as ws:
        json.loads(ws.recv(30))
        ws.send(json.dumps({"type": "generate", "id": "s", "max_new_tokens": 2000, "alternatives": 5,
                            "messages": [{"role": "user", "content": "Tell a long story."}]}))
        chunks = 0
        while chunks < 5:
            if json.loads(ws.recv(60))["type"] == "chunk":
                chunks += 1
        t0 = time.perf_counter()
        ws.send(json.dumps({"type": "stop", "id": "s"}))
        while processing(upstream_port):
            time.sleep(0.002)
        return (time.perf_counter() - t0) * 1000


def close_trial(upstream_port: int, model: str) -> float:
    body = {"model": model, "messages": [{"role": "user", "content": "Tell a long story."}], "max_tokens": 2000,
            "stream": True, "logprobs": True, "top_logprobs": 5}
    with httpx.stream("POST", f"http://127.0.0.1:{upstream_port}/v1/chat/completions", json=body, timeout=60) as r:
        chunks = 0
        for line in r.iter_lines():
            if line.startswith("data: ") and '"content"' in line:
                chunks += 1
                if chunks >= 5:
                    break
        t0 = time.perf_counter()
    while processing(upstream_port):
        time.sleep(0.002)
    return (time.perf_counter() - t0) * 1000


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gguf", type=Path, default=None)
    ap.add_argument("--llama-server", type=Path, default=None)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--trials", type=int, default=10)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--threads", type=int, default=THREADS,
                    help="llama-server's -t (default 2: every core of this machine, shared with webchat's front and "
                         "the clients; 1 leaves a core to them, as when the engine has a machine of its own)")
    args = ap.parse_args()
    gguf = args.gguf or default_gguf()
    binary = find_llama_server(args.llama_server)
    stops = stop_token_ids(gguf)
    up_port, front_port = free_port(), free_port()
    with (llama_server(binary, gguf, up_port, 16 * 2048, threads=args.threads) as upstream,
          front_server(up_port, front_port, stops) as front):
        print(f"llama-server {binary} -t {args.threads} on {gguf.name}; webchat serve --engine-url in front ({ROOT})")
        heatmap_and_branch(front_port)
        stops_ms = [stop_trial(front_port, up_port) for _ in range(args.trials)]
        closes_ms = [close_trial(up_port, upstream.model) for _ in range(args.trials)]
        print(f"Stop through webchat → llama-server idle: median {statistics.median(stops_ms):.1f} ms, "
              f"max {max(stops_ms):.1f} ms ({args.trials} trials)")
        print(f"client closes llama-server's own stream → idle: median {statistics.median(closes_ms):.1f} ms, "
              f"max {max(closes_ms):.1f} ms")
        best: dict[tuple[str, int], float] = {}
        front_cpu: dict[int, list[float]] = {1: [], 16: []}  # the front's CPU ms per streamed token
        for rnd in range(args.rounds):
            for server in (upstream, front):
                for n in (1, 16):
                    c0 = front.cpu_s()
                    sec = concurrent(server, n, args.tokens, offset=rnd * 7 + n)
                    if server is front:
                        front_cpu[n].append((front.cpu_s() - c0) * 1000 / sum(s.tokens for s in sec.streams))
                    key = (server.name, n)
                    best[key] = max(best.get(key, 0.0), sec.aggregate)
        print(table_header("clients", "llama-server tok/s", "through webchat", "ratio", "front CPU ms/token",
                           align="rrrrr"))
        for n in (1, 16):
            a, b = best[(upstream.name, n)], best[(front.name, n)]
            print(table_row(n, f"{a:.1f}", f"{b:.1f}", f"{b / a:.2f}", f"{min(front_cpu[n]):.2f}"))

if __name__ == "__main__":
    main()
