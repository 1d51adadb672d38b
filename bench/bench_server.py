"""What the server costs on top of the generator: tokens/s and time to first chunk a websocket client sees, with
probabilities on and off, the same for the OpenAI API's SSE stream (httpx client), and aggregate throughput and
per-client spread with 1, 4 and 16 concurrent clients.

A real uvicorn serves the default model on a free port in this process; clients use the `websockets` library. Greedy,
the end-of-turn token biased away (`token_bias`) so every run makes exactly `--tokens` tokens.
Run: `.venv/bin/python bench/bench_server.py` (`--model DIR`, `--device cuda` on a GPU machine).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import statistics
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import uvicorn
import websockets

from webchat.server import Runtime, ServerConfig, create_app, load_runtime

PROMPT = "Write a long story about a dragon who learns to bake bread."


@dataclass
class Run:
    """One request as a client saw it; times in seconds from sending `generate`."""

    first_chunk: float
    done: float
    tokens: int
    chunks: int
    server_tps: float  # the generator's own decode tokens/s for this request (done.stats)

    @property
    def client_tps(self) -> float:
        return (self.tokens - 1) / max(self.done - self.first_chunk, 1e-9)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@contextmanager
def serving(config: ServerConfig, runtime: Runtime) -> Iterator[str]:
    server = uvicorn.Server(uvicorn.Config(create_app(config, runtime=runtime), host="127.0.0.1", port=config.port,
                                           ws="websockets-sansio", log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.02)
    try:
        yield f"ws://127.0.0.1:{config.port}/ws"
    finally:
        server.should_exit = True
        thread.join(30)


def request(rid: str, tokens: int, alternatives: int, eos_ids: list[int]) -> str:
    return json.dumps({"type": "generate", "id": rid, "messages": [{"role": "user", "content": PROMPT}],
                       "settings": {"temperature": 0.0, "token_bias": {str(t): -100.0 for t in eos_ids}},
                       "max_new_tokens": tokens, "alternatives": alternatives})


async def one_client(url: str, rid: str, tokens: int, alternatives: int, eos_ids: list[int]) -> Run:
    async with websockets.connect(url, max_size=None) as ws:
        json.loads(await ws.recv())  # hello
        t0 = time.perf_counter()
        await ws.send(request(rid, tokens, alternatives, eos_ids))
        first, chunks = 0.0, 0
        while True:
            msg = json.loads(await ws.recv())
            if msg["type"] == "chunk":
                chunks += 1
                first = first or time.perf_counter() - t0
            elif msg["type"] == "error":
                raise RuntimeError(f"request {rid} failed: {msg}")
            elif msg["type"] == "done":
                stats = msg["stats"]
                return Run(first, time.perf_counter() - t0, stats["new_tokens"], chunks, stats["decode_tps"])


async def clients(url: str, n: int, tokens: int, alternatives: int, eos_ids: list[int]) -> tuple[list[Run], float]:
    t0 = time.perf_counter()
    runs = await asyncio.gather(*(one_client(url, f"c{i}", tokens, alternatives, eos_ids) for i in range(n)))
    return list(runs), time.perf_counter() - t0


def direct(runtime: Runtime, tokens: int, alternatives: int, eos_ids: list[int]) -> tuple[float, float]:
    """The generator alone, no server: (decode tokens/s, time to first token ms)."""
    from webchat.generator import GenerationRequest
    from webchat.sampling import SamplingSettings

    gen = runtime.new_generator()
    settings = SamplingSettings(temperature=0.0, token_bias={t: -100.0 for t in eos_ids})
    gen.begin_stream(GenerationRequest(prompt_ids=runtime.encode_chat([{"role": "user", "content": PROMPT}]),
                                       settings=settings, max_new_tokens=tokens, return_probs=alternatives > 0,
                                       top_alts=alternatives))
    while not (res := gen.stream()).eos:
        pass
    assert res.stats is not None
    return res.stats.decode_tps, res.stats.ttft_ms


def single_client_table(url: str, runtime: Runtime, tokens: int, eos_ids: list[int], repeats: int) -> None:
    """Runs alternate (alone, through the server) so that a noisy machine drifts both the same way."""
    print(f"\n## One client, {tokens} tokens (median of {repeats} runs each, alone and served interleaved)")
    print("| probabilities | generator alone tok/s | generator in server tok/s | client receives tok/s "
          "| overhead vs alone ms/token | of which after the generator ms/token | time to first chunk ms "
          "| generator alone TTFT ms | chunks |")
    print("|---|---|---|---|---|---|---|---|---|")
    for alternatives in (0, 5, 20):
        alone: list[tuple[float, float]] = []
        runs: list[Run] = []
        for _ in range(repeats):
            alone.append(direct(runtime, tokens, alternatives, eos_ids))
            runs.append(asyncio.run(clients(url, 1, tokens, alternatives, eos_ids))[0][0])
        # overhead: the client's time per token minus the generator's alone (paired runs), and minus the
        # generator's own in the same served run (what the socket path adds after the worker's step)
        overhead_ms = statistics.median((1 / r.client_tps - 1 / a[0]) * 1000 for r, a in zip(runs, alone, strict=True))
        socket_ms = statistics.median((1 / r.client_tps - 1 / r.server_tps) * 1000 for r in runs)
        label = "off" if alternatives == 0 else f"on, {alternatives} alternatives"
        print(f"| {label} | {statistics.median(a[0] for a in alone):.1f} "
              f"| {statistics.median(r.server_tps for r in runs):.1f} "
              f"| {statistics.median(r.client_tps for r in runs):.1f} | {overhead_ms:+.2f} | {socket_ms:+.2f} "
              f"| {statistics.median(r.first_chunk for r in runs) * 1000:.0f} "
              f"| {statistics.median(a[1] for a in alone):.0f} | {statistics.median(r.chunks for r in runs):.0f} |")


def concurrency_table(url: str, counts: list[int], tokens: int, eos_ids: list[int]) -> None:
    print(f"\n## Concurrent clients, {tokens} tokens each, probabilities off")
    print("| clients | aggregate tok/s | per-client tok/s min / median / max | first chunk s min / median / max "
          "| wall s |")
    print("|---|---|---|---|---|")
    for n in counts:
        runs, wall = asyncio.run(clients(url, n, tokens, 0, eos_ids))
        tps = sorted(r.client_tps for r in runs)
        first = sorted(r.first_chunk for r in runs)
        total = sum(r.tokens for r in runs)
        print(f"| {n} | {total / wall:.1f} | {tps[0]:.2f} / {statistics.median(tps):.2f} / {tps[-1]:.2f} "
              f"| {first[0]:.2f} / {statistics.median(first):.2f} / {first[-1]:.2f} | {wall:.1f} |")


# ---------------------------------------------------------------- the OpenAI API's SSE stream beside the websocket
async def sse_client(http_url: str, model: str, tokens: int, top_logprobs: int, eos_ids: list[int]) -> Run:
    """One streamed /v1/chat/completions as an httpx client sees it (the same request as `request()`)."""
    import httpx

    body: dict[str, object] = {"model": model, "messages": [{"role": "user", "content": PROMPT}], "temperature": 0,
                               "max_tokens": tokens, "logit_bias": {str(t): -100 for t in eos_ids}, "stream": True,
                               "stream_options": {"include_usage": True}}
    if top_logprobs:
        body.update(logprobs=True, top_logprobs=top_logprobs)
    async with httpx.AsyncClient(timeout=None) as client:
        t0 = time.perf_counter()
        async with client.stream("POST", f"{http_url}/v1/chat/completions", json=body) as response:
            first, chunks, used, server_tps = 0.0, 0, 0, 0.0
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    used = chunk["usage"]["completion_tokens"]
                elif chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                    chunks += 1
                    first = first or time.perf_counter() - t0
                if "stats" in chunk:  # webchat's extension on the finish chunk: the generator's own rate
                    server_tps = chunk["stats"]["decode_tps"]
            return Run(first, time.perf_counter() - t0, used, chunks, server_tps)


def sse_table(ws_url: str, runtime: Runtime, tokens: int, eos_ids: list[int], repeats: int) -> None:
    """Generator alone, websocket and SSE clients, runs interleaved. Two ratios: SSE client tok/s over the generator's
    own decode tok/s in the same served run (paired, so a noisy machine moves both), and over the generator alone."""
    http_url = ws_url.replace("ws://", "http://").removesuffix("/ws")
    print(f"\n## OpenAI API (SSE) beside the websocket, one client, {tokens} tokens (median of {repeats} runs each)")
    print("| probabilities | generator alone tok/s | websocket client tok/s | SSE client tok/s "
          "| SSE / generator, same run | SSE / generator alone | SSE / websocket | SSE first chunk ms |")
    print("|---|---|---|---|---|---|---|---|")
    for alternatives in (0, 5):
        alone: list[float] = []
        ws_runs: list[Run] = []
        sse_runs: list[Run] = []
        for _ in range(repeats):
            alone.append(direct(runtime, tokens, alternatives, eos_ids)[0])
            ws_runs.append(asyncio.run(clients(ws_url, 1, tokens, alternatives, eos_ids))[0][0])
            sse_runs.append(asyncio.run(sse_client(http_url, runtime.model_name, tokens, alternatives, eos_ids)))
        assert all(r.tokens == tokens for r in sse_runs), [r.tokens for r in sse_runs]
        gen, ws, sse = (statistics.median(x) for x in (alone, [r.client_tps for r in ws_runs],
                                                         [r.client_tps for r in sse_runs]))
        paired = statistics.median(r.client_tps / r.server_tps for r in sse_runs)
        label = "off" if alternatives == 0 else f"on, {alternatives} top_logprobs"
        print(f"| {label} | {gen:.1f} | {ws:.1f} | {sse:.1f} | {paired:.3f} | {sse / gen:.3f} | {sse / ws:.3f} "
              f"| {statistics.median(r.first_chunk for r in sse_runs) * 1000:.0f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path, default=None, help="default: the pulled SmolLM2-135M-Instruct")
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--tokens", type=int, default=64, help="new tokens per single-client run")
    parser.add_argument("--concurrent-tokens", type=int, default=32, help="new tokens per client when concurrent")
    parser.add_argument("--clients", default="1,4,16")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--api-only", action="store_true", help="only the OpenAI API (SSE) beside websocket table")
    args = parser.parse_args()
    if args.model is None:
        from webchat.pull import ensure_default_model

        args.model = ensure_default_model()
    counts = [int(c) for c in args.clients.split(",")]
    config = ServerConfig(model_dir=args.model, device=args.device, port=free_port(), max_sessions=max(counts),
                          max_queue=max(counts), max_seq_len=1024)
    runtime = load_runtime(config)
    eos_ids: list[int] = list(runtime.tokenizer.stop_token_ids)
    import torch

    print(f"# bench_server: {runtime.model_name} on {runtime.device} ({runtime.dtype}), torch threads "
          f"{torch.get_num_threads()}, prompt {len(runtime.encode_chat([{'role': 'user', 'content': PROMPT}]))} "
          "tokens")
    direct(runtime, 8, 0, eos_ids)  # warm-up
    with serving(config, runtime) as url:
        if not args.api_only:
            single_client_table(url, runtime, args.tokens, eos_ids, args.repeats)
        sse_table(url, runtime, args.tokens, eos_ids, args.repeats)
        if not args.api_only:
            concurrency_table(url, counts, args.concurrent_tokens, eos_ids)


if __name__ == "__main__":
    main()
