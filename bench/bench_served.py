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
  long    one ~1,000-token prompt (`--long-tokens`): TTFT and the decode after it; then its next turn (the reply sent
          back and a question): TTFT, the long prompt's cache reused
Peak RSS of each server process over its round is printed too.

    bash bench/build_llama_server.sh                      # once, ~10 minutes on 2 cores
    .venv/bin/python -m bench.bench_served                # SmolLM2-135M Q4_1 (the default model's GGUF)
    bash bench/make_bench_files.sh                        # once: issue 38's files, then:
    .venv/bin/python -m bench.bench_served --set issue38
    .venv/bin/python -m bench.bench_served --only webchat --clients 1 --rounds 6 --bare   # served against bare
    .venv/bin/python -m bench.bench_served --paired 15 --rounds 2                           # the same, paired
    .venv/bin/python -m bench.bench_served --speculation  # each speculative mode against none (served_speculation)
    .venv/bin/python -m bench.bench_served --isa avx2 --set issue38   # both servers as on an AVX2-only CPU (Zen 3)

`--isa avx2` runs webchat with WEBCHAT_QPATH=avx2 WEBCHAT_VNNI=0 (its table label says what /api/info reported) and a
llama-server built without AVX-512 or VNNI (LLAMA_ISA=avx2 bench/build_llama_server.sh): the code an AVX2-only CPU
runs, on this machine's memory and cores (so not that CPU's figures: its vector units and caches differ).

`--bare` also runs bench.bench_cpu's webchat child (the bare forward on the main thread, no server) after the
servers in every round, and prints each round's single-client served aggregate against that bare decode, and the
median: the served stream's share of the engine's own speed, measured in one run. Beside it, the served stream's decode
alone (first token to last) against the same bare decode: what the aggregate loses beyond that is its TTFT.
`--paired N` measures the same ratio with the two sides a second apart instead of a minute: per round, one server
and one bare child (bench.bench_cpu --engine webchat --repeat) stay alive side by side, never both busy, and N
single-client streams (each a new topic) alternate with N bare decodes; it prints every pair, the median, the
quartiles and how many pairs reach 0.9. Each round's server and child are new processes, so the rounds also sample
how much one process differs from the next.

Token counts come from each server's `usage` (stream_options.include_usage); per-client decode is
(tokens - 1) / (last content chunk - first content chunk), so a server that merges tokens into fewer chunks is not
penalised or favoured.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from bench import served_speculation
from bench.common import (
    ROOT,
    THREADS,
    Section,
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
from bench.served_files import (
    MEMORY_BOUND_BYTES,
    SETS,
    has_exact_flag,
    matrix_bytes,
    precision_of,
    read_bandwidth,
    set_files,
    weights_line,
)
from bench.served_prompts import long_chat, short_chat

C1_RUNS = 3  # single-client runs a round; the median one is kept
FOLLOW_UP = "Which of these decisions matters most, and why?"


def run_sections(server: Server, tokens: int, clients: list[int], rnd: int,
                 long_tokens: int = 1000) -> dict[str, Section]:
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
    notes = long_chat(max(1, round(long_tokens / 100)))
    long = server.stream(notes, tokens)
    out["long"] = Section("long", [long], long.end - t0, {"prompt_tokens": float(long.prompt_tokens)})
    # the next turn of that conversation: the reply sent back and a question (the long prompt's cache reused)
    t0 = time.perf_counter()
    turn = [*notes, {"role": "assistant", "content": long.text}, {"role": "user", "content": FOLLOW_UP}]
    follow = server.stream(turn, tokens)
    out["follow"] = Section("follow", [follow], follow.end - t0, {"prompt_tokens": float(follow.prompt_tokens)})
    return out


def bare_decode(src: Path) -> float:
    """bench.bench_cpu's webchat child from the checkout `src`: the bare forward's decode on its short prompt."""
    env = dict(os.environ, PYTHONPATH=str(src))
    out = subprocess.run([sys.executable, "-m", "bench.bench_cpu", "--engine", "webchat"], cwd=src, env=env,
                         capture_output=True, text=True, check=True)
    return float(json.loads(out.stdout.strip().splitlines()[-1])["short"]["decode_tps"])


class BareChild:
    """bench.bench_cpu's webchat child kept alive (`--repeat`): one bare short-prompt decode each time it is asked."""

    def __init__(self, src: Path) -> None:
        env = dict(os.environ, PYTHONPATH=str(src))
        self.proc = subprocess.Popen([sys.executable, "-m", "bench.bench_cpu", "--engine", "webchat", "--repeat"],
                                     cwd=src, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
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
    out: list[tuple[float, float, float]] = []
    for i in (i for i in range(pairs + 1) if i != 3):
        if len(out) == pairs:
            break
        c1 = concurrent(server, 1, tokens, offset=i)
        bare_tps = bare.decode()
        out.append((c1.aggregate, c1.decode_median, bare_tps))
        print(f"  pair {len(out)}: served aggregate {c1.aggregate:.1f} tok/s (decode alone {c1.decode_median:.1f}), "
              f"bare decode {bare_tps:.1f}: {c1.aggregate / bare_tps:.2f}x", flush=True)
    return out


def fmt_ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x" if b else "n/a"


def paired_main(gguf: Path, src: Path, tokens: int, rounds: int, n: int) -> None:
    print(f"{gguf.name}, {tokens} greedy tokens, {THREADS} threads: webchat serve's single client against "
          f"bench.bench_cpu's bare decode, {n} pairs in each of {rounds} rounds (a new server and bare child each "
          "round)",
          flush=True)
    stops = stop_token_ids(gguf)
    pairs: list[tuple[float, float, float]] = []
    for rnd in range(rounds):
        print(f"round {rnd + 1}", flush=True)
        bare = BareChild(src)
        server = webchat_server(free_port(), gguf, src=src, stops=stops)
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


@dataclass
class FileRun:
    """One file's rounds: each server's best section (by aggregate, by TTFT for one-stream sections), peak RSS and
    what /api/info said of its precision; with --bare, (served c1 aggregate, its decode, bare decode) per round."""

    best: dict[str, dict[str, Section]]
    rss: dict[str, int]
    precision: dict[str, str] = field(default_factory=dict)
    pairs: list[tuple[float, float, float]] = field(default_factory=list)

    def keep(self, name: str, sections: dict[str, Section], server: Server) -> None:
        self.rss[name] = max(self.rss.get(name, 0), server.peak_rss)
        if server.info_path is not None:
            self.precision[name] = precision_of(server.info)
        mine = self.best.setdefault(name, {})
        for sec in sections.values():
            old = mine.get(sec.name)
            if sec.name in ("repeat", "long", "follow"):
                better = old is None or sec.streams[0].ttft_ms < old.streams[0].ttft_ms
            else:
                better = old is None or sec.aggregate > old.aggregate
            if better:
                mine[sec.name] = sec


def run_file(makers: dict[str, Callable[[int], Server]], tokens: int, clients: list[int], rounds: int,
             bare_src: Path | None, long_tokens: int = 1000) -> FileRun:
    """`rounds` rounds of every server in turn (one process at a time); with bare_src, bench.bench_cpu's bare decode
    after webchat's each round."""
    run = FileRun({}, {})
    for rnd in range(rounds):
        for name, make in makers.items():
            server = make(free_port())
            try:
                server.wait_ready()
                sections = run_sections(server, tokens, clients, rnd, long_tokens)
            finally:
                server.stop()
            run.keep(name, sections, server)
            summary = ", ".join(f"{k} {v.aggregate:.1f} tok/s" for k, v in sections.items() if k.startswith("c"))
            print(f"round {rnd + 1} {name}: {summary}; repeat TTFT {sections['repeat'].streams[0].ttft_ms:.0f} ms; "
                  f"long TTFT {sections['long'].streams[0].ttft_ms:.0f} ms", flush=True)
            if name == "webchat" and bare_src is not None:
                bare = bare_decode(bare_src)
                c1 = sections["c1"]
                run.pairs.append((c1.aggregate, c1.decode_median, bare))
                print(f"round {rnd + 1} bare webchat (bench.bench_cpu): decode {bare:.1f} tok/s; served c1 aggregate / "
                      f"bare {c1.aggregate / bare:.2f}x, its decode alone / bare {c1.decode_median / bare:.2f}x",
                      flush=True)
    return run


def print_table(run: FileRun, clients: list[int]) -> None:
    """One row per figure, one column per server, then each webchat column's ratio against llama-server."""
    names = list(run.best)
    ours = [n for n in names if n != "llama-server"]
    peer = "llama-server" in names
    label = {n: f"{n} ({run.precision[n]})" if n in run.precision else n for n in names}
    ratios = [f"{n} / llama" for n in ours] if peer else []
    print(table_header("section", *(label[n] for n in names), *ratios))

    def row(title: str, values: dict[str, float], unit: str, lower_better: bool = False) -> None:
        cells = [f"{values[n]:.1f} {unit}" for n in names]
        for n in ours if peer else []:
            theirs = values["llama-server"]
            cells.append(fmt_ratio(theirs, values[n]) if lower_better else fmt_ratio(values[n], theirs))
        print(table_row(title, *cells))

    best = run.best
    for n in clients:
        key = f"c{n}"
        row(f"{n} client(s): aggregate", {m: best[m][key].aggregate for m in names}, "tok/s")
        row(f"{n} client(s): decode median / client", {m: best[m][key].decode_median for m in names}, "tok/s")
        row(f"{n} client(s): decode min / client", {m: best[m][key].decode_min for m in names}, "tok/s")
        row(f"{n} client(s): TTFT median", {m: best[m][key].ttft_median for m in names}, "ms", lower_better=True)
    row("repeated short prompt: TTFT (2nd)", {m: best[m]["repeat"].streams[0].ttft_ms for m in names}, "ms", True)
    row("short prompt: TTFT (1st)", {m: best[m]["repeat"].extra["first_ttft_ms"] for m in names}, "ms", True)
    long_tokens = "/".join(str(int(best[m]["long"].extra["prompt_tokens"])) for m in names)
    row(f"long prompt ({long_tokens} tok): TTFT", {m: best[m]["long"].streams[0].ttft_ms for m in names}, "ms", True)
    row("long prompt: decode after it", {m: best[m]["long"].streams[0].decode_tps for m in names}, "tok/s")
    row("its next turn: TTFT", {m: best[m]["follow"].streams[0].ttft_ms for m in names}, "ms", True)
    row("peak RSS", {m: run.rss[m] / 2**20 for m in names}, "MiB", True)
    if peer:
        print("\nratio: webchat / llama-server for tok/s; llama-server / webchat for times and memory "
              "(>1: webchat better)")


def print_bare(pairs: list[tuple[float, float, float]]) -> None:
    ratios = [served / bare for served, _, bare in pairs]
    print(f"\nserved single-client aggregate / bare decode (bench.bench_cpu), round by round: "
          f"{', '.join(f'{r:.2f}' for r in ratios)}; median {statistics.median(ratios):.2f}x (target >= 0.9)")
    decode = [served / bare for _, served, bare in pairs]  # the aggregate less its TTFT (the new turn's prefill)
    print(f"its decode alone (first token to last) / bare decode, round by round: "
          f"{', '.join(f'{r:.2f}' for r in decode)}; median {statistics.median(decode):.2f}x")


def webchat_makers(gguf: Path, src: Path, precision: str, exact_flag: bool, spec_none: bool = False,
                   serve_args: Sequence[str] = ()) -> dict[str, Callable[[int], Server]]:
    """"webchat" (its default precision) and/or "webchat --exact", as --precision asks and the checkout allows; and
    "webchat --speculative none" beside the default where `spec_none` (the kernels alone, no drafts). `serve_args` go
    to every one of them (`--kv-pool 9000`: a long prompt on a model whose default pool is smaller)."""
    stops = stop_token_ids(gguf)
    makers: dict[str, Callable[[int], Server]] = {}
    if precision in ("both", "default") or not exact_flag:
        makers["webchat"] = lambda port: webchat_server(port, gguf, *serve_args, src=src, stops=stops)
        if spec_none:
            makers["webchat --speculative none"] = lambda port: webchat_server(
                port, gguf, *serve_args, "--speculative", "none", src=src, stops=stops,
                name="webchat --speculative none")
    if precision in ("both", "exact") and exact_flag:
        makers["webchat --exact"] = lambda port: webchat_server(port, gguf, *serve_args, src=src, stops=stops,
                                                                exact=True)
    return makers


def commit_of(src: Path) -> str:
    """A checkout's short commit (its folder's name where it is no git checkout)."""
    out = subprocess.run(["git", "-C", str(src), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return out.stdout.strip() or src.name


def peer_maker(binary: Path, gguf: Path, ctx: int, parallel: int) -> Callable[[int], Server]:
    return lambda port: llama_server(binary, gguf, port, ctx, parallel)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gguf", type=Path, action="append", default=[],
                        help="GGUF file, repeatable: one table each (default: the default model's Q4_1)")
    parser.add_argument("--set", choices=list(SETS), default=None,
                        help="issue38: the 1.1B file in Q4_0/Q4_1/Q8_0/Q4_K_M and the 3B Q4_K_M of "
                             "bench/make_bench_files.sh; kquants: the 1.1B in Q5_K_M and Q6_K; 8b: Llama-3.1-8B's "
                             "shape at Q4_K_M (WITH_8B=1); after any --gguf "
                             "(clients 1,4 unless --clients)")
    parser.add_argument("--llama-server", type=Path, default=None, help="binary (default: bench/build_llama_server.sh)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--long-tokens", type=int, default=1000,
                        help="the long prompt's size, ~100 tokens a meeting's notes (8000 with --ctx 9000: a long "
                        "conversation; the default file's context is 8,192)")
    parser.add_argument("--clients", default=None,
                        help="concurrent clients per section (default 1,4,16; 1,4 with --set)")
    parser.add_argument("--ctx", type=int, default=None,
                        help="llama-server's total context (-c), split over -np (the most clients); 2048 a slot")
    parser.add_argument("--kv-pool", default=None, metavar="SIZE",
                        help="webchat's --kv-pool (tokens or memory, as `serve` reads it): the 3B file's default 1 GiB "
                             "pool holds 4,688 tokens at float32, so an 8,000-token prompt needs --kv-pool 9000")
    parser.add_argument("--only", choices=["webchat", "llama-server"], default=None)
    parser.add_argument("--precision", choices=["both", "default", "exact"], default="both",
                        help="webchat's servers: its default precision and `serve --exact` beside it (both, where the "
                             "checkout has --exact), or one of them")
    parser.add_argument("--spec-none", action="store_true",
                        help="webchat --speculative none as a column beside webchat's default flags")
    parser.add_argument("--bandwidth", action="store_true",
                        help="measure the read bandwidth before every file (default: files past 1 GiB of matrices)")
    parser.add_argument("--isa", choices=["native", "avx2"], default="native",
                        help="avx2: both servers as on a Zen 3-class CPU on this one: webchat with WEBCHAT_QPATH=avx2 "
                             "WEBCHAT_VNNI=0, llama-server built without AVX-512 or VNNI (LLAMA_ISA=avx2 "
                             "bench/build_llama_server.sh, its own build tree)")
    parser.add_argument("--src", type=Path, default=ROOT, help="the webchat checkout to serve from")
    parser.add_argument("--against", type=Path, default=None,
                        help="another webchat checkout served in the same run, alternating, as its own column "
                             "(before and after a change: `--against ../old --only webchat`)")
    parser.add_argument("--bare", action="store_true",
                        help="each round, bench.bench_cpu's bare webchat decode too (the default model; needs "
                             "clients 1)")
    parser.add_argument("--paired", type=int, default=0, metavar="N",
                        help="served against bare only: per round, one server and one bare child alive side by side "
                             "(never both busy), N single-client streams each followed by a bare decode (N <= 15)")
    served_speculation.add_arguments(parser)
    args = parser.parse_args()
    args.clients = [int(c) for c in (args.clients or (SETS[args.set][1] if args.set else "1,4,16")).split(",")]
    args.files = [g.expanduser().resolve() for g in args.gguf] + (set_files(args.set) if args.set else [])
    if args.paired and (args.files or not 0 < args.paired <= 15):
        parser.error("--paired N compares webchat with its bare forward on the default model, 1 <= N <= 15 (the "
                     "topics that keep every prompt new)")
    if args.bare and (1 not in args.clients or args.only == "llama-server" or args.files):
        parser.error("--bare compares webchat's single client on the default model: keep 1 in --clients, no --gguf "
                     "or --set, no --only llama-server")
    return args


def exact_available(args: argparse.Namespace) -> bool:
    """Whether to start `webchat serve --exact`; says so plainly where the checkout lacks the flag."""
    if args.only == "llama-server" or args.precision == "default":
        return False
    if has_exact_flag(args.src.resolve()):
        return True
    if args.precision == "exact":
        raise SystemExit(f"--precision exact: `webchat serve` in {args.src} has no --exact (issue 38's precision "
                         "choice has not landed in this checkout)")
    print(f"note: `webchat serve` in {args.src} has no --exact (issue 38's precision choice has not landed in this "
          "checkout): only its default server runs, whose activations are float32 (today's exact path), and no "
          "`precision` is expected in its /api/info", flush=True)
    return False


def convert_first(gguf: Path, src: Path) -> None:
    """The file converted into webchat's cache (once, kept) before any round: a server that converted it at start
    would count the converter's memory in its peak RSS (the 3B file's first int8 round: 4.7 GB against 3.0). A
    checkout without a GGUF cache (before GGUF files were served) is left to convert at start; one from before the
    package's folders (webchat/gguf_path.py) is asked in its own layout."""
    layouts = {"webchat.files.gguf_cache": "files/gguf_cache.py", "webchat." + "gguf_path": "gguf_path.py"}
    module = next((m for m, f in layouts.items() if (src / "webchat" / f).exists()), None)
    if module is None:
        return
    code = f"import sys, pathlib, {module} as g; g.model_folder(pathlib.Path(sys.argv[1]))"
    env = dict(os.environ, PYTHONPATH=str(src))
    subprocess.run([sys.executable, "-c", code, str(gguf)], check=True, cwd=src, env=env)


def main() -> None:
    args = parse_args()
    src = args.src.resolve()
    if args.isa == "avx2":  # inherited by every server and build this run starts; the table names what each took
        os.environ.update(WEBCHAT_QPATH="avx2", WEBCHAT_VNNI="0", LLAMA_ISA="avx2")
        print("--isa avx2: webchat's kernels forced to AVX2 without VNNI, llama-server built without AVX-512 or "
              "VNNI (an AVX2-class CPU's code on this one; its memory and cores stay this machine's)", flush=True)
    if args.speculation:
        served_speculation.main(args, args.files[0] if args.files else default_gguf())
        return
    if args.paired:
        paired_main(default_gguf(), src, args.tokens, args.rounds, args.paired)
        return
    exact_flag = exact_available(args)
    binary = find_llama_server(args.llama_server) if args.only != "webchat" else None
    parallel = max(args.clients)
    ctx = args.ctx or 2048 * parallel
    for gguf in args.files or [default_gguf()]:
        if args.only != "llama-server":
            convert_first(gguf, src)
        serve_args = ("--kv-pool", args.kv_pool) if args.kv_pool else ()
        makers = webchat_makers(gguf, src, args.precision, exact_flag, args.spec_none, serve_args) \
            if args.only != "llama-server" else {}
        if args.against is not None:
            against = args.against.resolve()
            convert_first(gguf, against)
            makers[f"webchat@{commit_of(against)}"] = webchat_makers(gguf, against, "default", False,
                                                                     serve_args=serve_args)["webchat"]
        if binary is not None:
            makers["llama-server"] = peer_maker(binary, gguf, ctx, parallel)
        gbps = None
        if args.bandwidth or matrix_bytes(gguf) > MEMORY_BOUND_BYTES:
            gbps = read_bandwidth(THREADS)
        print(f"\n{gguf.name}, {args.tokens} greedy tokens, {THREADS} threads, {args.rounds} rounds (best kept), "
              f"servers alternating, one at a time ({', '.join(makers)}; llama-server -np {parallel} -c {ctx})",
              flush=True)
        run = run_file(makers, args.tokens, args.clients, args.rounds, src if args.bare else None, args.long_tokens)
        print()
        print_table(run, args.clients)
        if 1 in args.clients:
            print(weights_line(gguf, {n: run.best[n]["c1"].decode_median for n in run.best}, gbps))
        if run.pairs:
            print_bare(run.pairs)


if __name__ == "__main__":
    main()
