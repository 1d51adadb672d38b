"""What a user gets: `webchat serve` against llama.cpp's `llama-server` on the same GGUF, through the OpenAI streaming
API, the way a client meets them.

Each server runs alone (never both at once) on the same file with 2 threads; the servers alternate for `--rounds`
rounds and each keeps its best round per section. Sections, greedy, end-of-turn biased away so every reply is
`--tokens` long:
  repeat  the same short chat sent twice: TTFT of the second (prefix reuse), and of the first
  c1/c4/c16  that many concurrent streams of a short chat (different prompts): TTFT, per-client decode (median and
          min), aggregate tok/s (all tokens / wall time from the first request to the last token); the single client
          runs three times a round (three prompts) and its median run by aggregate is kept: one 96-token stream is
          under a second, and alone it moved the served-against-bare ratio by 0.8-1.1 between rounds
  long    one ~1,000-token prompt: TTFT and the decode after it
Peak RSS of each server process over its round is printed too.

    bash bench/build_llama_server.sh                       # once, ~10 minutes on 2 cores
    .venv/bin/python bench/bench_served.py                 # SmolLM2-135M Q4_1 (the default model's GGUF)
    .venv/bin/python bench/make_tinyllama_gguf.py          # the 1.1B-shaped file, then:
    .venv/bin/python bench/bench_served.py --gguf ~/.cache/webchat/tinyllama-shape-q4_1.gguf
    .venv/bin/python bench/bench_served.py --only webchat --clients 1 --rounds 6 --bare   # served against bare
    .venv/bin/python bench/bench_served.py --paired 15 --rounds 2                           # the same, paired
    .venv/bin/python bench/bench_served.py --speculation    # each speculative mode against none (served_speculation)

`--bare` also runs bench/bench_cpu.py's webchat child (the bare forward on the main thread, no server) after the
servers in every round, and prints each round's single-client served aggregate against that bare decode, and the
median: the served stream's share of the engine's own speed, measured in one run. Beside it, the served stream's decode
alone (first token to last) against the same bare decode: what the aggregate loses beyond that is its TTFT.
`--paired N` measures the same ratio with the two sides a second apart instead of a minute: per round, one server
and one bare child (bench_cpu.py --engine webchat --repeat) stay alive side by side, never both busy, and N
single-client streams (each a new topic) alternate with N bare decodes; it prints every pair, the median, the
quartiles and how many pairs reach 0.9. Each round's server and child are new processes, so the rounds also sample
how much one process differs from the next.

Token counts come from each server's `usage` (stream_options.include_usage); per-client decode is
(tokens - 1) / (last content chunk - first content chunk), so a server that merges tokens into fewer chunks is not
penalised or favoured.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]
THREADS = 2
C1_RUNS = 3  # single-client runs a round; the median one is kept
TOPICS = ["a lighthouse keeper", "a city under the sea", "a robot gardener", "the last train home", "a winter market",
          "a lost violin", "two rival bakers", "a map with no names", "a comet over the desert", "a library at night",
          "a ship in a bottle", "the mountain post office", "a clockmaker's apprentice", "a river that ran uphill",
          "a festival of lanterns", "an orchard in the fog"]
LONG_PARAGRAPH = (
    "Here are my notes from the meeting. We discussed the quarterly roadmap, the hiring plan for the platform team, "
    "the migration of the billing service to the new database cluster, and the incident from last Tuesday when the "
    "cache layer returned stale prices for about forty minutes. The action items were: write a postmortem, add an "
    "alert on cache age, review the rollout checklist, and schedule a load test before the holiday freeze. ")


def short_chat(i: int) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"Write a long story about {TOPICS[i % len(TOPICS)]}."}]


def long_chat() -> list[dict[str, str]]:
    text = " ".join(f"Meeting {k + 1}. {LONG_PARAGRAPH}" for k in range(10))  # ~1,000 tokens with either tokenizer
    return [{"role": "user", "content": text + "Summarise these notes as a short list of decisions."}]


@dataclass
class Stream:
    ttft_ms: float
    tokens: int
    decode_tps: float
    end: float  # perf_counter of the last content chunk
    prompt_tokens: int = 0


@dataclass
class Section:
    name: str
    streams: list[Stream]
    wall_s: float
    extra: dict[str, float] = field(default_factory=dict)

    @property
    def aggregate(self) -> float:
        return sum(s.tokens for s in self.streams) / self.wall_s

    @property
    def decode_median(self) -> float:
        return statistics.median(s.decode_tps for s in self.streams)

    @property
    def decode_min(self) -> float:
        return min(s.decode_tps for s in self.streams)

    @property
    def ttft_median(self) -> float:
        return statistics.median(s.ttft_ms for s in self.streams)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class Server:
    """One server process on one port; `body` adds its own way of biasing end-of-turn away."""

    def __init__(self, name: str, argv: list[str], port: int, env: dict[str, str] | None = None,
                 extra_body: dict[str, object] | None = None, ready_path: str = "/health",
                 cwd: Path | None = None) -> None:
        self.name, self.port, self.extra_body, self.ready_path = name, port, extra_body or {}, ready_path
        self.proc = subprocess.Popen(argv, env=env, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        # the log read as it comes, its end kept for errors: a server that logs more than the pipe holds (64 KB;
        # llama-server logs every request) would otherwise stop at its next write
        self._log: deque[bytes] = deque(maxlen=64)
        threading.Thread(target=self._drain, daemon=True).start()
        self.peak_rss = 0
        self.model = "default"
        self._sampling = True
        self._sampler = threading.Thread(target=self._sample_rss, daemon=True)

    def _drain(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self._log.append(line)

    def _sample_rss(self) -> None:
        status = Path(f"/proc/{self.proc.pid}/status")
        while self._sampling:
            try:
                for line in status.read_text().splitlines():
                    if line.startswith("VmRSS:"):
                        self.peak_rss = max(self.peak_rss, int(line.split()[1]) * 1024)
            except OSError:
                return
            time.sleep(0.05)

    def wait_ready(self, timeout: float = 600.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                time.sleep(0.2)  # the drain's last lines
                err = b"".join(self._log).decode(errors="replace")[-2000:]
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}:\n{err}")
            try:
                conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=2)
                conn.request("GET", self.ready_path)
                if conn.getresponse().status == 200:
                    conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=10)
                    conn.request("GET", "/v1/models")
                    self.model = json.loads(conn.getresponse().read())["data"][0]["id"]
                    self._sampler.start()
                    return
            except OSError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"{self.name} did not answer on port {self.port} within {timeout:.0f} s")

    def stop(self) -> None:
        self._sampling = False
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def stream(self, messages: list[dict[str, str]], tokens: int) -> Stream:
        body = {"model": self.model, "messages": messages, "max_tokens": tokens, "temperature": 0, "stream": True,
                "stream_options": {"include_usage": True}, **self.extra_body}
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=600)
        t0 = time.perf_counter()
        conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            raise RuntimeError(f"{self.name}: HTTP {resp.status}: {resp.read()[:300]!r}")
        first = last = 0.0
        chunks = 0
        usage: dict[str, int] = {}
        for raw in resp:
            line = raw.strip()
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            choices = chunk.get("choices") or []
            if choices and (choices[0].get("delta") or {}).get("content"):
                last = time.perf_counter()
                first = first or last
                chunks += 1
        conn.close()
        n = int(usage.get("completion_tokens", chunks))
        if n < 2 or not first:
            raise RuntimeError(f"{self.name}: expected a stream of tokens, got {n} ({chunks} content chunks)")
        decode = (n - 1) / (last - first) if last > first else float("nan")
        return Stream((first - t0) * 1000, n, decode, last, int(usage.get("prompt_tokens", 0)))


def concurrent(server: Server, clients: int, tokens: int, offset: int) -> Section:
    results: list[Stream | BaseException] = [RuntimeError("not run")] * clients

    def one(i: int) -> None:
        try:
            results[i] = server.stream(short_chat(offset + i), tokens)
        except BaseException as exc:  # noqa: BLE001 - reported below
            results[i] = exc

    threads = [threading.Thread(target=one, args=(i,)) for i in range(clients)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    streams = []
    for r in results:
        if isinstance(r, BaseException):
            raise RuntimeError(f"{server.name}, {clients} clients: {r}") from r
        streams.append(r)
    return Section(f"c{clients}", streams, max(s.end for s in streams) - t0)


def run_sections(server: Server, tokens: int, clients: list[int], rnd: int) -> dict[str, Section]:
    out: dict[str, Section] = {}
    server.stream(short_chat(99), 8)  # warm-up: lazy set-up out of the figures
    msgs = [{"role": "user", "content": f"Round {rnd}: what is the capital of France? Answer in one long paragraph."}]
    first = server.stream(msgs, tokens)
    t0 = time.perf_counter()
    again = server.stream(msgs, tokens)
    out["repeat"] = Section("repeat", [again], again.end - t0, {"first_ttft_ms": first.ttft_ms})
    for n in clients:  # the single client's prompts: offsets +1..+3, clear of c4's +4..+7
        tries = [concurrent(server, n, tokens, offset=rnd * 7 + n + k) for k in range(C1_RUNS if n == 1 else 1)]
        out[f"c{n}"] = sorted(tries, key=lambda sec: sec.aggregate)[len(tries) // 2]
    t0 = time.perf_counter()
    long = server.stream(long_chat(), tokens)
    out["long"] = Section("long", [long], long.end - t0, {"prompt_tokens": float(long.prompt_tokens)})
    return out


def bare_decode(src: Path) -> float:
    """bench_cpu.py's webchat child from the checkout `src`: the bare forward's decode on its short prompt."""
    env = dict(os.environ, PYTHONPATH=str(src))
    out = subprocess.run([sys.executable, str(src / "bench" / "bench_cpu.py"), "--engine", "webchat"], cwd=src, env=env,
                         capture_output=True, text=True, check=True)
    return float(json.loads(out.stdout.strip().splitlines()[-1])["short"]["decode_tps"])


class BareChild:
    """bench_cpu.py's webchat child kept alive (`--repeat`): one bare short-prompt decode each time it is asked."""

    def __init__(self, src: Path) -> None:
        env = dict(os.environ, PYTHONPATH=str(src))
        self.proc = subprocess.Popen([sys.executable, str(src / "bench" / "bench_cpu.py"), "--engine", "webchat",
                                      "--repeat"], cwd=src, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True)
        self._read()  # {"ready": true}: loaded and warmed up

    def _read(self) -> dict[str, float]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the bare child ended (exit {self.proc.wait()})")
        out: dict[str, float] = json.loads(line)
        return out

    def decode(self) -> float:
        assert self.proc.stdin is not None
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()
        return float(self._read()["decode_tps"])

    def stop(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(30)


def run_paired(server: Server, bare: BareChild, tokens: int, pairs: int) -> list[tuple[float, float, float]]:
    """`pairs` times: one single-client stream (a new topic each time, so no prompt is reused whole), then one bare
    decode, a second apart: (served aggregate, its decode alone, bare decode) per pair."""
    server.stream(short_chat(99), 8)  # warm-up (topic 99 % 16 = 3 is never one of the pairs' prompts)
    out = []
    for i in (i for i in range(pairs + 1) if i != 3):
        if len(out) == pairs:
            break
        c1 = concurrent(server, 1, tokens, offset=i)
        bare_tps = bare.decode()
        out.append((c1.aggregate, c1.decode_median, bare_tps))
        print(f"  pair {len(out)}: served aggregate {c1.aggregate:.1f} tok/s (decode alone {c1.decode_median:.1f}), "
              f"bare decode {bare_tps:.1f}: {c1.aggregate / bare_tps:.2f}x", flush=True)
    return out


def stop_token_ids(gguf: Path) -> list[int]:
    from gguf import GGUFReader

    reader = GGUFReader(str(gguf))
    ids = set()
    for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id"):
        f = reader.fields.get(key)
        if f is not None:
            ids.add(int(f.parts[f.data[0]][0]))
    return sorted(ids)


def webchat_server(gguf: Path, port: int, stops: list[int], src: Path) -> Server:
    """`webchat serve` from the checkout `src`: run from inside it, since `python -m` puts the working directory ahead
    of PYTHONPATH (from another checkout's folder, that checkout's package would be the one served)."""
    env = dict(os.environ, PYTHONPATH=str(src))
    argv = [sys.executable, "-m", "webchat.cli", "serve", "--model", str(gguf), "--device", "cpu", "--port", str(port)]
    return Server("webchat", argv, port, env, {"logit_bias": {str(t): -100 for t in stops}}, "/healthz", cwd=src)


def llama_server(binary: Path, gguf: Path, port: int, ctx: int) -> Server:
    argv = [str(binary), "-m", str(gguf), "--port", str(port), "--host", "127.0.0.1", "-t", str(THREADS),
            "-tb", str(THREADS), "-np", "16", "-c", str(ctx), "--no-webui"]
    return Server("llama-server", argv, port, None, {"ignore_eos": True}, "/health")


def default_gguf() -> Path:
    from webchat.pull import ensure_default_gguf

    return ensure_default_gguf()


def built_by(script: str, given: Path | None) -> Path:
    """`given`, else the path bench/<script> prints last (it builds what it names once, then only prints it)."""
    if given is not None:
        return given
    out = subprocess.run(["bash", str(HERE / "bench" / script)], check=True, capture_output=True, text=True)
    return Path(out.stdout.strip().splitlines()[-1])


def find_llama_server(given: Path | None) -> Path:
    return built_by("build_llama_server.sh", given)


def fmt_ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x" if b else "n/a"


def paired_main(gguf: Path, src: Path, tokens: int, rounds: int, n: int) -> None:
    print(f"{gguf.name}, {tokens} greedy tokens, {THREADS} threads: webchat serve's single client against "
          f"bench_cpu.py's bare decode, {n} pairs in each of {rounds} rounds (a new server and bare child each round)",
          flush=True)
    stops = stop_token_ids(gguf)
    pairs: list[tuple[float, float, float]] = []
    for rnd in range(rounds):
        print(f"round {rnd + 1}", flush=True)
        bare = BareChild(src)
        server = webchat_server(gguf, free_port(), stops, src)
        try:
            server.wait_ready()
            pairs += run_paired(server, bare, tokens, n)
        finally:
            server.stop()
            bare.stop()
    ratios = [served / bare_tps for served, _, bare_tps in pairs]
    decode = [served / bare_tps for _, served, bare_tps in pairs]
    q = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
    print(f"\nserved single-client aggregate / bare decode, {len(ratios)} pairs: "
          f"median {statistics.median(ratios):.2f}x (quartiles {q[0]:.2f} / {q[2]:.2f}; "
          f"{sum(r >= 0.9 for r in ratios)} of {len(ratios)} pairs >= 0.9; target >= 0.9)")
    print(f"its decode alone (first token to last) / bare decode: median {statistics.median(decode):.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gguf", type=Path, default=None, help="GGUF file (default: the default model's Q4_1)")
    parser.add_argument("--llama-server", type=Path, default=None, help="binary (default: bench/build_llama_server.sh)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--clients", default="1,4,16")
    parser.add_argument("--ctx", type=int, default=16 * 2048, help="llama-server's total context (-c), split by -np 16")
    parser.add_argument("--only", choices=["webchat", "llama-server"], default=None)
    parser.add_argument("--src", type=Path, default=HERE, help="the webchat checkout to serve from")
    parser.add_argument("--bare", action="store_true",
                        help="each round, bench_cpu.py's bare webchat decode too (the default model; needs clients 1)")
    parser.add_argument("--paired", type=int, default=0, metavar="N",
                        help="served against bare only: per round, one server and one bare child alive side by side "
                             "(never both busy), N single-client streams each followed by a bare decode (N <= 15)")
    import served_speculation  # bench/: the --speculation comparison, its own options and functions

    served_speculation.add_arguments(parser)
    args = parser.parse_args()
    gguf = (args.gguf or default_gguf()).resolve()
    if args.speculation:
        served_speculation.main(args, gguf)
        return
    clients = [int(c) for c in args.clients.split(",")]
    if args.paired:
        if args.gguf is not None or not 0 < args.paired <= 15:
            parser.error("--paired N compares webchat with its bare forward on the default model, 1 <= N <= 15 (the "
                         "topics that keep every prompt new)")
        paired_main(gguf, args.src.resolve(), args.tokens, args.rounds, args.paired)
        return
    if args.bare and (1 not in clients or args.only == "llama-server" or args.gguf is not None):
        parser.error("--bare compares webchat's single client on the default model: keep 1 in --clients, no --gguf, "
                     "no --only llama-server")
    stops = stop_token_ids(gguf)
    makers: dict[str, Callable[[int], Server]] = {}
    if args.only in (None, "webchat"):
        makers["webchat"] = lambda port: webchat_server(gguf, port, stops, args.src.resolve())
    if args.only in (None, "llama-server"):
        binary = find_llama_server(args.llama_server)
        makers["llama-server"] = lambda port: llama_server(binary, gguf, port, args.ctx)
    print(f"{gguf.name}, {args.tokens} greedy tokens, {THREADS} threads, {args.rounds} rounds (best kept), "
          f"servers alternating, one at a time", flush=True)
    best: dict[str, dict[str, Section]] = {name: {} for name in makers}
    rss: dict[str, int] = {name: 0 for name in makers}

    def better(name: str, sec: Section) -> bool:
        old = best[name].get(sec.name)
        if old is None:
            return True
        if sec.name in ("repeat", "long"):
            return sec.streams[0].ttft_ms < old.streams[0].ttft_ms
        return sec.aggregate > old.aggregate

    pairs: list[tuple[float, float, float]] = []  # --bare: (served c1 aggregate, its decode, bare decode) per round
    for rnd in range(args.rounds):
        for name, make in makers.items():
            server = make(free_port())
            try:
                server.wait_ready()
                sections = run_sections(server, args.tokens, clients, rnd)
            finally:
                server.stop()
            rss[name] = max(rss[name], server.peak_rss)
            for sec in sections.values():
                if better(name, sec):
                    best[name][sec.name] = sec
            summary = ", ".join(f"{k} {v.aggregate:.1f} tok/s" for k, v in sections.items() if k.startswith("c"))
            print(f"round {rnd + 1} {name}: {summary}; repeat TTFT {sections['repeat'].streams[0].ttft_ms:.0f} ms; "
                  f"long TTFT {sections['long'].streams[0].ttft_ms:.0f} ms", flush=True)
            if name == "webchat" and args.bare:
                bare = bare_decode(args.src.resolve())
                c1 = sections["c1"]
                pairs.append((c1.aggregate, c1.decode_median, bare))
                print(f"round {rnd + 1} bare webchat (bench_cpu.py): decode {bare:.1f} tok/s; served c1 aggregate / "
                      f"bare {c1.aggregate / bare:.2f}x, its decode alone / bare {c1.decode_median / bare:.2f}x",
                      flush=True)

    names = list(makers)
    print()
    print(f"| section | {' | '.join(names)} | ratio |" if len(names) == 2 else f"| section | {names[0]} |")
    print("|---|" + "---:|" * (len(names) + (1 if len(names) == 2 else 0)))

    def row(label: str, values: list[float], unit: str, lower_better: bool = False) -> None:
        cells = [f"{v:.1f} {unit}" for v in values]
        if len(values) == 2:
            ratio = fmt_ratio(values[1], values[0]) if lower_better else fmt_ratio(values[0], values[1])
            cells.append(ratio + (" (llama/webchat)" if lower_better else ""))
        print(f"| {label} | {' | '.join(cells)} |")

    for n in clients:
        key = f"c{n}"
        row(f"{n} client(s): aggregate", [best[m][key].aggregate for m in names], "tok/s")
        row(f"{n} client(s): decode median / client", [best[m][key].decode_median for m in names], "tok/s")
        row(f"{n} client(s): decode min / client", [best[m][key].decode_min for m in names], "tok/s")
        row(f"{n} client(s): TTFT median", [best[m][key].ttft_median for m in names], "ms", lower_better=True)
    row("repeated short prompt: TTFT (2nd)", [best[m]["repeat"].streams[0].ttft_ms for m in names], "ms", True)
    row("short prompt: TTFT (1st)", [best[m]["repeat"].extra["first_ttft_ms"] for m in names], "ms", True)
    long_tokens = [int(best[m]["long"].extra["prompt_tokens"]) for m in names]
    row(f"long prompt ({'/'.join(map(str, long_tokens))} tok): TTFT", [best[m]["long"].streams[0].ttft_ms
                                                                       for m in names], "ms", True)
    row("long prompt: decode after it", [best[m]["long"].streams[0].decode_tps for m in names], "tok/s")
    row("peak RSS", [rss[m] / 2**20 for m in names], "MiB", True)
    print("\nratio: webchat / llama-server for tok/s; llama-server / webchat for times and memory (>1: webchat better)")
    if pairs:
        ratios = [served / bare for served, _, bare in pairs]
        print(f"\nserved single-client aggregate / bare decode (bench_cpu.py), round by round: "
              f"{', '.join(f'{r:.2f}' for r in ratios)}; median {statistics.median(ratios):.2f}x (target >= 0.9)")
        decode = [served / bare for _, served, bare in pairs]  # the aggregate less its TTFT (the new turn's prefill)
        print(f"its decode alone (first token to last) / bare decode, round by round: "
              f"{', '.join(f'{r:.2f}' for r in decode)}; median {statistics.median(decode):.2f}x")


if __name__ == "__main__":
    main()
