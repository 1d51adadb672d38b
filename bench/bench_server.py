"""What the server costs on top of the generator: tokens/s and time to first chunk a websocket client sees, with
probabilities on and off, the same for the OpenAI API's SSE stream (httpx client), and aggregate throughput and
per-client spread with 1, 4 and 16 concurrent clients.

The batched engine's figures (issue 10) come after: aggregate tok/s against one client's, memory with 16 sessions
each holding a finished 300-token conversation against the model's RSS + 1.2 x their KV bytes, idle memory against
--max-sessions, the gaps of 4 streams while a 3,000-token prompt prefills, and single-stream decode against another
checkout's code (`--compare-src /work/main`), each engine in its own process, interleaved.

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

from webchat.serve.app import create_app
from webchat.serve.config import ServerConfig
from webchat.serve.runtime import Runtime, load_runtime

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


def direct(runtime: Runtime, tokens: int, alternatives: int, eos_ids: list[int],
           messages: list[dict[str, str]] | None = None) -> tuple[float, float]:
    """The generator alone, no server: (decode tokens/s, time to first token ms)."""
    from webchat.engine.sequence import GenerationRequest
    from webchat.engine.settings import SamplingSettings

    gen = runtime.new_generator()
    settings = SamplingSettings(temperature=0.0, token_bias={t: -100.0 for t in eos_ids})
    messages = messages or [{"role": "user", "content": PROMPT}]
    gen.begin_stream(GenerationRequest(prompt_ids=runtime.encode_chat(messages),
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
    print("| clients | aggregate tok/s | x one client | per-client tok/s min / median / max | spread "
          "| first chunk s min / median / max | wall s |")
    print("|---|---|---|---|---|---|---|")
    one = 0.0
    for n in counts:
        runs, wall = asyncio.run(clients(url, n, tokens, 0, eos_ids))
        tps = sorted(r.client_tps for r in runs)
        first = sorted(r.first_chunk for r in runs)
        aggregate = sum(r.tokens for r in runs) / wall
        one = one or aggregate  # the first count is the baseline (1 by default)
        spread = (tps[-1] - tps[0]) / statistics.median(tps)  # (max - min) / median of the per-client rates
        print(f"| {n} | {aggregate:.1f} | {aggregate / one:.2f} | {tps[0]:.2f} / {statistics.median(tps):.2f} / "
              f"{tps[-1]:.2f} | {spread:.0%} | {first[0]:.2f} / {statistics.median(first):.2f} / {first[-1]:.2f} "
              f"| {wall:.1f} |")


# ---------------------------------------------------------------- the batched engine (issue 10)
FILLER = ("The river ran past the old mill, and the miller counted the sacks of grain while the children played by "
          "the water. ")


def chat(i: int, words: int) -> list[dict[str, str]]:
    """A conversation of its own per session (distinct from the first user token; the template opening is shared)."""
    return [{"role": "user", "content": f"Session {i}: " + FILLER * words}]


async def timed_client(url: str, rid: str, messages: list[dict[str, str]], tokens: int, eos_ids: list[int],
                       stamps: list[float]) -> dict[str, object]:
    """One request; appends the arrival time of every chunk to stamps; returns its `done` message."""
    async with websockets.connect(url, max_size=None) as ws:
        json.loads(await ws.recv())  # hello
        await ws.send(json.dumps({"type": "generate", "id": rid, "messages": messages, "max_new_tokens": tokens,
                                  "settings": {"temperature": 0.0,
                                               "token_bias": {str(t): -100.0 for t in eos_ids}}}))
        while True:
            msg = json.loads(await ws.recv())
            if msg["type"] == "chunk":
                stamps.append(time.perf_counter())
            elif msg["type"] in ("done", "error"):
                if msg["type"] == "error":
                    raise RuntimeError(f"request {rid} failed: {msg}")
                return dict(msg)


def no_stall_table(url: str, eos_ids: list[int], long_words: int) -> None:
    """4 streams decode; once each has 10 chunks a ~3,000-token prompt arrives; the 4 streams' gaps between chunks."""

    async def scenario() -> tuple[list[list[float]], float, float, int]:
        stamps: list[list[float]] = [[] for _ in range(4)]
        streams = [asyncio.create_task(timed_client(url, f"s{i}", chat(i, 1), 160, eos_ids, stamps[i]))
                   for i in range(4)]
        while min(len(st) for st in stamps) < 10:
            await asyncio.sleep(0.01)
        t_long = time.perf_counter()
        long_stamps: list[float] = []
        done = await timed_client(url, "long", chat(99, long_words), 4, eos_ids, long_stamps)
        await asyncio.gather(*streams)
        stats = done["stats"]
        assert isinstance(stats, dict)
        return stamps, t_long, long_stamps[0], int(stats["prompt_tokens"])

    stamps, t_long, t_first, n_long = asyncio.run(scenario())
    gaps = [b - a for st in stamps for a, b in zip(st, st[1:], strict=False)]
    during = [b - a for st in stamps for a, b in zip(st, st[1:], strict=False) if b > t_long and a < t_first]
    med, longest = statistics.median(gaps), max(gaps)
    print(f"\n## No stall: 4 streams decode 160 tokens; a {n_long}-token prompt arrives after their 10th chunk")
    print("| long prompt to first chunk s | 4 streams' median gap ms | longest gap ms | longest / median "
          "| longest gap while it prefills ms |")
    print("|---|---|---|---|---|")
    print(f"| {t_first - t_long:.2f} | {med * 1000:.0f} | {longest * 1000:.0f} | {longest / med:.2f} "
          f"| {max(during, default=0.0) * 1000:.0f} |")


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def peak_rss_mb() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def memory_probe(model: Path, sessions: int, max_sessions: int, turn_tokens: int) -> dict[str, float]:
    """In a fresh process: RSS after loading (and one warm-up request), then `sessions` connections each finishing
    one conversation of about turn_tokens tokens and staying connected; peak RSS and KV bytes of those turns."""
    from webchat.model.kv_cache import kv_bytes_per_token

    config = ServerConfig(model_dir=model, device="cpu", port=free_port(), max_sessions=max_sessions,
                          max_queue=max(sessions, 1), max_seq_len=4096)
    runtime = load_runtime(config)
    eos_ids = list(runtime.tokenizer.stop_token_ids)
    # warm-up: the allocator's working set for a decode step (the C++ forward) and for a prefill chunk of more than 64
    # tokens (the PyTorch path), as the turns below take both
    direct(runtime, 8, 0, eos_ids, chat(sessions, 10))
    runtime.engine.reset()
    base = rss_mb()
    tokens = 0
    with serving(config, runtime) as url:
        idle = rss_mb()

        async def hold_all() -> int:
            conns = [await websockets.connect(url, max_size=None) for _ in range(sessions)]
            total = 0
            for ws in conns:
                json.loads(await ws.recv())
            for i, ws in enumerate(conns):
                prompt = len(runtime.encode_chat(chat(i, 10)))
                await ws.send(json.dumps({"type": "generate", "id": f"m{i}", "messages": chat(i, 10),
                                          "max_new_tokens": max(1, turn_tokens - prompt),
                                          "settings": {"temperature": 0.0,
                                                       "token_bias": {str(t): -100.0 for t in eos_ids}}}))
            for ws in conns:
                while (msg := json.loads(await ws.recv()))["type"] != "done":
                    pass
                total += msg["stats"]["prompt_tokens"] + msg["stats"]["new_tokens"]
            for ws in conns:  # connected, each holding its finished turn's pages
                await ws.close()
            return total

        if sessions:
            tokens = asyncio.run(hold_all())
    per_token = kv_bytes_per_token(runtime.model.args, runtime.model.dtype)
    return {"model_rss_mb": base, "idle_rss_mb": idle, "peak_rss_mb": peak_rss_mb(), "tokens": tokens,
            "kv_mb": tokens * per_token / 2**20}


def subprocess_json(args: list[str], env: dict[str, str] | None = None, cwd: str | None = None) -> dict[str, object]:
    import os
    import subprocess
    import sys

    out = subprocess.run([sys.executable, *args], capture_output=True, text=True, check=False, cwd=cwd,
                         env={**os.environ, **(env or {})})
    if out.returncode != 0:
        raise RuntimeError(f"{args} failed ({out.returncode}): {out.stderr[-2000:]}")
    result: dict[str, object] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def memory_table(model: Path) -> None:
    me = str(Path(__file__).resolve())
    sixteen = subprocess_json([me, "--probe-memory", "16,64", "--model", str(model)])
    print("\n## Memory: 16 connected sessions, each holding a finished ~300-token conversation (own process)")
    print("| model RSS MB | KV of the 16 turns MB | model RSS + 1.2 x KV MB | peak RSS MB | within |")
    print("|---|---|---|---|---|")
    base, kv, peak = (float(sixteen[k]) for k in ("model_rss_mb", "kv_mb", "peak_rss_mb"))  # type: ignore[arg-type]
    print(f"| {base:.0f} | {kv:.0f} ({sixteen['tokens']} tokens) | {base + 1.2 * kv:.0f} | {peak:.0f} "
          f"| {peak <= base + 1.2 * kv} |")
    print("\n## Idle server memory against --max-sessions (own process each)")
    print("| --max-sessions | RSS with the server up, no session MB |")
    print("|---|---|")
    for n in (4, 256):
        idle = subprocess_json([me, "--probe-memory", f"0,{n}", "--model", str(model)])
        print(f"| {n} | {float(idle['idle_rss_mb']):.0f} |")  # type: ignore[arg-type]


PROBE = """
import json, sys
from webchat.engine.generator import Generator
from webchat.engine.sequence import GenerationRequest
from webchat.model.loader import load_model
from webchat.engine.settings import SamplingSettings
from webchat.text.tokenizer import Tokenizer
import webchat

model_dir, tokens, repeats, prompt, weights = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]
model = load_model(model_dir, weights=weights) if weights else load_model(model_dir)  # older code: no weights=
tok = Tokenizer.from_dir(model_dir)
ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True))
settings = SamplingSettings(temperature=0.0, token_bias={t: -100.0 for t in tok.stop_token_ids})
gen, tps = Generator(model, tok, max_seq_len=1024), []
for _ in range(repeats + 1):
    gen.begin_stream(GenerationRequest(prompt_ids=ids, settings=settings, max_new_tokens=tokens))
    while not (res := gen.stream()).eos:
        pass
    tps.append(res.stats.decode_tps)
print(json.dumps({"src": webchat.__file__, "tps": tps[1:]}))
"""


def single_stream_vs(model: Path, other_src: Path, tokens: int, rounds: int, weights: str = "") -> None:
    """Decode tok/s of one stream, this checkout (with `weights` if given) vs other_src, alternating processes."""
    here = Path(__file__).resolve().parent.parent
    rows: dict[str, list[float]] = {"this checkout": [], str(other_src): []}
    srcs = {"this checkout": here, str(other_src): other_src}
    for _ in range(rounds):
        for label, src in srcs.items():
            here_weights = weights if src == here else ""
            got = subprocess_json(["-c", PROBE, str(model), str(tokens), "2", PROMPT, here_weights],
                                  env={"PYTHONPATH": str(src)}, cwd="/")
            if not str(got["src"]).startswith(str(src)):
                raise RuntimeError(f"the probe for {src} imported webchat from {got['src']}")
            rows[label] += got["tps"]  # type: ignore[arg-type]
    print(f"\n## Single stream decode, {tokens} tokens, greedy ({rounds} rounds x 2 runs, processes alternating; "
          f"this checkout's weights: {weights or 'default'})")
    print("| code | median tok/s | min / max |")
    print("|---|---|---|")
    for label, tps in rows.items():
        print(f"| {label} | {statistics.median(tps):.2f} | {min(tps):.2f} / {max(tps):.2f} |")
    a, b = (statistics.median(t) for t in rows.values())
    print(f"\nthis checkout / {other_src}: {a / b:.3f}")


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
    parser.add_argument("--sections", default="single,sse,concurrent,engine",
                        help="comma list of: single, sse, concurrent, engine (no-stall, memory), memory")
    parser.add_argument("--compare-src", type=Path, default=None,
                        help="another checkout (e.g. /work/main) whose single-stream decode to compare with")
    parser.add_argument("--compare-weights", default="", choices=["", "auto", "float32", "quantized"],
                        help="this checkout's --weights in the --compare-src run (float32: the engine alone)")
    parser.add_argument("--long-words", type=int, default=120, help="filler repeats of the no-stall prompt (~25 tok)")
    parser.add_argument("--probe-memory", default=None, help=argparse.SUPPRESS)  # "sessions,max_sessions"
    parser.add_argument("--api-only", action="store_true", help="only the OpenAI API (SSE) beside websocket table")
    args = parser.parse_args()
    if args.model is None:
        from webchat.pull import ensure_default_model

        args.model = ensure_default_model()
    if args.probe_memory is not None:
        sessions, max_sessions = (int(x) for x in args.probe_memory.split(","))
        print(json.dumps(memory_probe(args.model, sessions, max_sessions, 300)))
        return
    sections = {"sse"} if args.api_only else set(args.sections.split(","))
    counts = [int(c) for c in args.clients.split(",")]
    config = ServerConfig(model_dir=args.model, device=args.device, port=free_port(), max_sessions=max(counts),
                          max_queue=max(counts), max_seq_len=4096)
    runtime = load_runtime(config)
    eos_ids: list[int] = list(runtime.tokenizer.stop_token_ids)
    import torch

    print(f"# bench_server: {runtime.model_name} on {runtime.device} ({runtime.dtype}), torch threads "
          f"{torch.get_num_threads()}, prompt {len(runtime.encode_chat([{'role': 'user', 'content': PROMPT}]))} "
          "tokens")
    direct(runtime, 8, 0, eos_ids)  # warm-up
    with serving(config, runtime) as url:
        if "single" in sections:
            single_client_table(url, runtime, args.tokens, eos_ids, args.repeats)
        if "sse" in sections:
            sse_table(url, runtime, args.tokens, eos_ids, args.repeats)
        if "concurrent" in sections:
            concurrency_table(url, counts, args.concurrent_tokens, eos_ids)
        if "engine" in sections:
            no_stall_table(url, eos_ids, args.long_words)
    if "engine" in sections or "memory" in sections:
        memory_table(args.model)
    if args.compare_src is not None:
        single_stream_vs(args.model, args.compare_src, args.tokens, args.repeats, args.compare_weights)


if __name__ == "__main__":
    main()
