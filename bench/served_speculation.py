"""`python -m bench.bench_served --speculation`: each speculative mode against `none`, served, in one run.

For each round, each mode (`--spec-modes`, default none,auto; the order alternates round by round) gets a new
`webchat serve --speculative MODE` on the same GGUF, alone on the machine; it answers, through the OpenAI streaming
API, every prompt set (`--spec-sets`: open questions, copy-with-a-fix, a code edit returning the whole function;
bench/served_prompts.py) at each client count (`--spec-clients`, default 1,4,16): that many concurrent streams, each
a distinct prompt (the single client: three prompts one after another, the median kept), greedy. Open questions are
`--tokens` long (end-of-turn biased away, as the served sections); copies and edits end where the model ends
them (at most `--spec-max-tokens`). Then `--spec-seeded` seeded sampled streams (temperature 0.8) alone and together.
Per mode each section keeps its best round (noise only slows).

Printed: each set and client count's aggregate tok/s per mode and against none; how often the auto planner drafted
(sequence-steps granted drafts / sequence-steps planned) and what share of the drafted tokens were accepted, from the
server's /api/info (`speculation`, read before and after each section); whether every mode's text equals none's, for
the same prompt (greedy alone and among the streams, and seeded); and the verify-cost curve the auto server measured
at its warm-up, with how its plans came true (the payoff factor per batch size) by the end of its first round.

`--spec-paired N` measures auto against none inside one `--speculative auto` server instead: per set and client
count, N pairs of a none section and an auto section back to back, each request naming its mode, the order alternating
and every section new prompts (a repeated prompt is refused: auto would copy the earlier reply). Both sides of each
ratio share the process and the minute, so the spread between server processes (0.77-1.30 on open questions where
nothing was drafted, bench/README.md) leaves the ratio; printed per section: the median ratio, its quartiles, the
pairs at or above 0.97, and what auto drafted; beside them the decode alone (first token to last, against none's) and
the ceiling: what auto would reach if every stream drafted as long as pays and every draft were accepted, from the
server's own verify-cost curve, its time between steps and the section's time to first token (`ceiling`).
`--spec-fill N` first puts N replies to other prompts of each set (copy, code) into the server's engine-wide index, as a
served engine holds its earlier requests' after a while: without it the pairs measure a server's first minutes, where
the other sessions' outputs (suffix decoding's source) are few.
"""

from __future__ import annotations

import argparse
import http.client
import json
import signal
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.common import Server, free_port, parallel, stop_token_ids, table_header, table_row, webchat_server
from bench.served_prompts import SETS
from webchat.engine.spec.rates import MAX_AUTO_DRAFT, MAX_STEP_ROWS
from webchat.engine.spec.verify_cost import VerifyCost

C1_RUNS = 3
FILL_AT = 100_000  # --spec-fill's prompts: far past the sections' own


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The --speculation options (bench_served's own are unchanged)."""
    g = parser.add_argument_group("speculation", "--speculation: each speculative mode against none, served")
    g.add_argument("--speculation", action="store_true", help="run the speculation comparison instead")
    g.add_argument("--spec-modes", default="none,auto", help="modes, none first (default none,auto)")
    g.add_argument("--spec-sets", default="open,copy,code", help=f"prompt sets of {list(SETS)}")
    g.add_argument("--spec-clients", default="1,4,16")
    g.add_argument("--spec-rounds", type=int, default=2)
    g.add_argument("--spec-max-tokens", type=int, default=320, help="cap on copy and code replies (default 320)")
    g.add_argument("--spec-seeded", type=int, default=4, help="seeded sampled streams per set (0: none)")
    g.add_argument("--spec-paired", type=int, default=0, metavar="N",
                   help="instead: one auto server, N pairs per set and client count of a none section and an auto "
                        "section back to back (each request names its mode), the ratio of each pair")
    g.add_argument("--spec-fill", type=int, default=0, metavar="N",
                   help="with --spec-paired: before each set's pairs, N replies to other prompts of the set, so the "
                        "engine-wide index holds what a served engine's does after a while (copy and code; open's "
                        "96 prompts are the pairs' own)")


@dataclass
class Reply:
    text: str
    tokens: int
    end: float  # perf_counter of the last content chunk
    first: float  # ... and of the first


@dataclass
class Section:
    tokens: int
    wall_s: float
    texts: list[str]
    decisions: dict[str, float] = field(default_factory=dict)
    ttft_s: float = 0.0  # the streams' mean time to their first token

    @property
    def tps(self) -> float:
        return self.tokens / self.wall_s

    @property
    def decode_tps(self) -> float:
        """Tokens over the time after the first token (the streams' mean): the decode alone."""
        return self.tokens / max(1e-9, self.wall_s - self.ttft_s)


def spec_server(gguf: Path, port: int, src: Path, mode: str) -> Server:
    return webchat_server(port, gguf, "--speculative", mode, src=src, name=f"webchat --speculative {mode}")


def ask(server: Server, messages: list[dict[str, str]], body: dict[str, Any]) -> Reply:
    payload = {"model": server.model, "messages": messages, "stream": True, "stream_options": {"include_usage": True},
               **body}
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=900)
    conn.request("POST", "/v1/chat/completions", json.dumps(payload), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    if resp.status != 200:
        raise RuntimeError(f"{server.name}: HTTP {resp.status}: {resp.read()[:300]!r}")
    text, end, first, usage = "", 0.0, 0.0, {}
    for raw in resp:
        line = raw.strip()
        if not line.startswith(b"data: ") or line == b"data: [DONE]":
            continue
        chunk = json.loads(line[6:])
        usage = chunk.get("usage") or usage
        choices = chunk.get("choices") or []
        piece = (choices[0].get("delta") or {}).get("content") if choices else None
        if piece:
            text += piece
            end = time.perf_counter()
            first = first or end
    conn.close()
    return Reply(text, int(usage.get("completion_tokens", 0)), end, first)


def info(server: Server) -> dict[str, Any]:
    """/api/info's `speculation`: the planner's counts, its verify-cost curve and payoff."""
    speculation: dict[str, Any] = server.get("/api/info").get("speculation") or {}
    return speculation


def decisions(before: dict[str, Any], after: dict[str, Any]) -> dict[str, float]:
    """The planner's counts over a section: sequence-steps planned and granted drafts, tokens drafted and accepted."""
    if not after:
        return {}

    def total(d: dict[str, Any], key: str) -> float:
        value = d.get(key, 0)
        return float(sum(value.values()) if isinstance(value, dict) else value)

    return {k: total(after, k) - total(before, k) for k in ("offers", "granted", "drafted", "accepted", "probes")}


def section(server: Server, chats: list[list[dict[str, str]]], body: dict[str, Any]) -> Section:
    """The chats as concurrent streams: all tokens / time from the first request to the last token."""
    before = info(server)
    t0 = time.perf_counter()
    replies = parallel([lambda c=c: ask(server, c, body) for c in chats])
    wall = max(r.end for r in replies) - t0
    return Section(sum(r.tokens for r in replies), wall, [r.text for r in replies], decisions(before, info(server)),
                   statistics.fmean(r.first - t0 for r in replies))


def ceiling(curve: dict[str, Any], clients: int) -> float:
    """Decode speed against none's if each of `clients` streams drafted k tokens a step and every one were accepted,
    at the best k (at most MAX_AUTO_DRAFT, the step at most MAX_STEP_ROWS rows): the per-token cost of a step of
    clients (1 + k) rows over that of clients rows, each step a forward on the server's measured curve plus its time
    between steps. What a verify row costs against a decode row bounds speculation whatever the drafts. The curve is
    one sequence's rows, exact for one client; several sequences each read their own k/v (bench.bench_verify_cost's
    `all B` shapes measure that ceiling)."""
    cost = VerifyCost({int(t): float(ms) for t, ms in curve["cost"]["forward_ms"].items()})
    gap = float(curve.get("between_steps_ms", 0.0))
    base = (cost.forward_ms(clients) + gap) / clients
    best = min((cost.forward_ms(clients * (1 + k)) + gap) / (clients * (1 + k))
               for k in range(MAX_AUTO_DRAFT + 1) if clients * (1 + k) <= max(MAX_STEP_ROWS, clients))
    return base / best


def warm_up(server: Server) -> None:
    ask(server, [{"role": "user", "content": "Hello!"}], {"max_tokens": 8, "temperature": 0})


def run_mode(server: Server, sets: list[str], clients: list[int], args: argparse.Namespace,
             stops: list[int]) -> dict[str, Section]:
    out: dict[str, Section] = {}
    warm_up(server)
    for name in sets:
        chat = SETS[name]
        body = set_body(name, args, stops)
        at = 0
        for n in clients:
            if n == 1:
                runs = [section(server, [chat(at + k)], body) for k in range(C1_RUNS)]
                texts = [t for r in runs for t in r.texts]  # in prompt order, for the identity check
                median = sorted(runs, key=lambda s: s.tps)[len(runs) // 2]
                median.texts = texts  # (in speed order, the check compared one prompt's reply with another's)
                out[f"{name} c1"] = median
                at += C1_RUNS
            else:
                out[f"{name} c{n}"] = section(server, [chat(at + i) for i in range(n)], body)
                at += n
        if args.spec_seeded:
            seeded = [dict(body, temperature=0.8, seed=1000 + i) for i in range(args.spec_seeded)]
            alone = [section(server, [chat(i)], seeded[i]).texts[0] for i in range(args.spec_seeded)]
            pairs = [(chat(i), seeded[i]) for i in range(args.spec_seeded)]
            together = [r.text for r in parallel([lambda p=p: ask(server, *p) for p in pairs])]
            out[f"{name} seeded"] = Section(0, 1.0, alone + together)
    return out


def set_body(name: str, args: argparse.Namespace, stops: list[int]) -> dict[str, Any]:
    """A set's request body: open questions run --tokens long (end of turn biased away), copies and edits end where
    the model ends them."""
    if name == "open":
        return {"max_tokens": args.tokens, "temperature": 0, "logit_bias": {str(t): -100 for t in stops}}
    return {"max_tokens": args.spec_max_tokens, "temperature": 0}


def fill(server: Server, name: str, n: int, body: dict[str, Any], asked: set[str]) -> int:
    """--spec-fill: replies to n other prompts of the set (from FILL_AT on, none asked before), 4 streams at a time,
    into the server's engine-wide index, as a served engine holds its earlier requests' replies after a while. Returns
    how many were asked."""
    chats: list[list[dict[str, str]]] = []
    i = FILL_AT
    while len(chats) < n and i < FILL_AT + 10 * n:
        chat, i = SETS[name](i), i + 1
        if (key := json.dumps(chat)) not in asked:
            asked.add(key)
            chats.append(chat)
    for k in range(0, len(chats), 4):
        section(server, chats[k : k + 4], body)
    return len(chats)


def paired(args: argparse.Namespace, gguf: Path, sets: list[str], clients: list[int], stops: list[int]) -> None:
    """--spec-paired N: one `--speculative auto` server; per set and client count, N pairs of a `none` section and an
    `auto` section back to back, each request naming its mode (the order alternates pair by pair, every section new
    prompts), so both sides of a ratio share the server process, its warm state and the minute: the spread between
    server processes, larger than speculation's effect on a shared 2-core machine, leaves the ratio."""
    server = spec_server(gguf, free_port(), args.src.resolve(), "auto")
    print(f"{gguf.name}: auto against none in one auto server, {args.spec_paired} pairs per section, the order "
          f"alternating; sets {', '.join(sets)}; clients {clients}", flush=True)
    print("\n" + table_header("set", "clients", "auto / none: median", "quartiles", "pairs >= 0.97",
                              "none tok/s (median)", "auto drafted in / accepted", "decode alone: auto / none",
                              "ceiling: decode / aggregate", align="lrrlrrlrl"), flush=True)
    try:
        server.wait_ready()
        warm_up(server)
        at, asked = 0, set[str]()
        for name in sets:
            if args.spec_fill and name != "open":
                body = dict(set_body(name, args, stops), speculative="auto")
                print(f"({name}: {fill(server, name, args.spec_fill, body, asked)} replies to other prompts of the set "
                      "in the index first)", flush=True)
            for n in clients:
                ratios, base, drafted = [], [], {"offers": 0.0, "granted": 0.0, "drafted": 0.0, "accepted": 0.0}
                decode, ceil = [], []
                for p in range(args.spec_paired):
                    order = ("none", "auto") if p % 2 == 0 else ("auto", "none")
                    got: dict[str, Section] = {}
                    for mode in order:
                        chats = [SETS[name](at + i) for i in range(n)]
                        at += n
                        for c in chats:  # a repeated prompt would let auto copy the earlier reply
                            key = json.dumps(c)
                            if key in asked:
                                raise SystemExit(f"the {name} set ran out of distinct prompts at {at} (or met one "
                                                 "--spec-fill asked): fewer --spec-paired pairs or clients")
                            asked.add(key)
                        got[mode] = section(server, chats, dict(set_body(name, args, stops), speculative=mode))
                    ratios.append(got["auto"].tps / got["none"].tps)
                    base.append(got["none"].tps)
                    decode.append(got["auto"].decode_tps / got["none"].decode_tps)
                    if n == 1:  # none's decode at the ceiling, its first token as it came
                        none, top = got["none"], ceiling(info(server), 1)
                        ceil.append(none.wall_s / (none.ttft_s + (none.wall_s - none.ttft_s) / top))
                    for k in drafted:
                        drafted[k] += got["auto"].decisions.get(k, 0.0)
                q = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
                share = f"{100 * drafted['granted'] / drafted['offers']:.0f}%" if drafted["offers"] else "-"
                top_cell = f"{top:.2f}x / {statistics.median(ceil):.2f}x" if ceil else "bench.bench_verify_cost"
                print(table_row(name, n, f"{statistics.median(ratios):.2f}x", f"{q[0]:.2f}-{q[2]:.2f}",
                                f"{sum(r >= 0.97 for r in ratios)}/{len(ratios)}", f"{statistics.median(base):.1f}",
                                f"{share} / {drafted['accepted']:.0f} of {drafted['drafted']:.0f}",
                                f"{statistics.median(decode):.2f}x", top_cell), flush=True)
        payoff = info(server).get("payoff") or {}
        print("\nthe server's payoff per batch size at the end (the factor on later plans' expected rates): "
              + (", ".join(f"{k}: {float(v):.2f}" for k, v in payoff.items()) or "none yet"))
    finally:
        server.stop()


def main(args: argparse.Namespace, gguf: Path) -> None:
    modes = args.spec_modes.split(",")
    sets = args.spec_sets.split(",")
    clients = [int(c) for c in args.spec_clients.split(",")]
    if modes[0] != "none" or any(s not in SETS for s in sets):
        raise SystemExit(f"--spec-modes must start with none (got {modes}); --spec-sets from {list(SETS)} (got {sets})")
    if args.spec_paired < 0:
        raise SystemExit(f"--spec-paired must be 0 (off) or a number of pairs, got {args.spec_paired}")
    if args.spec_fill < 0 or (args.spec_fill and not args.spec_paired):
        raise SystemExit(f"--spec-fill must be 0 (off) or a number of replies, with --spec-paired; got "
                         f"--spec-fill {args.spec_fill} --spec-paired {args.spec_paired}")
    stops = stop_token_ids(gguf)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a kill stops the server it started too (`finally`)
    if args.spec_paired:
        paired(args, gguf, sets, clients, stops)
        return
    src = args.src.resolve()
    print(f"{gguf.name}: speculative modes {', '.join(modes)} served, {args.spec_rounds} rounds (best kept), the "
          f"modes alternating, one server at a time; sets {', '.join(sets)}; clients {clients}", flush=True)
    best: dict[str, dict[str, Section]] = {m: {} for m in modes}
    rounds: dict[str, list[dict[str, Section]]] = {m: [] for m in modes}
    curve: dict[str, Any] = {}
    for rnd in range(args.spec_rounds):
        for mode in modes if rnd % 2 == 0 else list(reversed(modes)):
            server = spec_server(gguf, free_port(), src, mode)
            try:
                server.wait_ready()
                got = run_mode(server, sets, clients, args, stops)
                if mode == "auto" and not curve:
                    curve = info(server)
            finally:
                server.stop()
            rounds[mode].append(got)
            for key, sec in got.items():
                if key not in best[mode] or sec.tps > best[mode][key].tps:
                    best[mode][key] = sec
            print(f"round {rnd + 1} {mode}: " + ", ".join(f"{k} {s.tps:.1f}" for k, s in got.items()
                                                         if not k.endswith("seeded")) + " tok/s", flush=True)
    report(modes, sets, clients, best, rounds, curve)


def report(modes: list[str], sets: list[str], clients: list[int], best: dict[str, dict[str, Section]],
           rounds: dict[str, list[dict[str, Section]]], curve: dict[str, Any]) -> None:
    others = modes[1:]
    columns = [c for m in others for c in (f"{m} tok/s", f"{m} / none")]
    per_round_title = "per-round " + "; ".join(f"{m} / none" for m in others)
    print("\n" + table_header("set", "clients", "none tok/s", *columns, per_round_title,
                              align="lrr" + "r" * len(columns) + "l"))
    for name in sets:
        for n in clients:
            key = f"{name} c{n}"
            base = best["none"][key].tps
            cells = [c for m in others for c in (f"{best[m][key].tps:.1f}", f"{best[m][key].tps / base:.2f}x")]
            per_round = ["/".join(f"{r[key].tps / b[key].tps:.2f}" for r, b in zip(rounds[m], rounds["none"],
                                                                                        strict=True)) for m in others]
            print(table_row(name, n, f"{base:.1f}", *cells, "; ".join(per_round)))
    if "auto" in modes:
        print("\nthe auto planner, each section's best round: sequence-steps granted drafts / planned, tokens accepted"
              " / drafted")
        for name in sets:
            row = []
            for n in clients:
                d = best["auto"][f"{name} c{n}"].decisions
                if d.get("offers"):
                    rate = f"{100 * d['accepted'] / d['drafted']:.0f}%" if d["drafted"] else "-"
                    row.append(f"c{n}: drafted in {100 * d['granted'] / d['offers']:.0f}% of "
                               f"{d['offers']:.0f}, accepted {d['accepted']:.0f}/{d['drafted']:.0f} ({rate})")
            print(f"  {name}: " + "; ".join(row))
    print("\nidentical text to none, every prompt of every round (greedy: alone and among the streams; seeded):")
    for m in others:
        same, total, where = 0, 0, []
        for r, (mine, base) in enumerate(zip(rounds[m], rounds["none"], strict=True)):
            for key, sec in mine.items():
                pairs = list(zip(sec.texts, base[key].texts, strict=True))
                same += sum(a == b for a, b in pairs)
                total += len(pairs)
                where += [f"round {r + 1} {key} #{i}" for i, (a, b) in enumerate(pairs) if a != b]
        print(f"  {m}: {same} of {total} replies identical" + ("" if same == total else "  <-- DIFFERENT: "
                                                                + ", ".join(where)))
    if curve.get("cost"):
        cost = curve["cost"]
        points = ", ".join(f"{t}: {float(ms):.2f}" for t, ms in cost["forward_ms"].items())
        one = float(cost["forward_ms"]["1"])
        five = statistics.fmean([float(cost["forward_ms"].get("4", one)), float(cost["forward_ms"].get("6", one))])
        print(f"\nthe auto server's verify-cost curve (rows -> forward ms, measured at its warm-up): {points}; past "
              f"the last point +{float(cost['slope_ms_per_row']):.2f} ms a row; a 5-row verify ~ {five / one:.2f} "
              f"one-row steps; time between steps {float(curve.get('between_steps_ms', 0)):.2f} ms (its last median)")
        print(f"on that curve one client's decode reaches at most {ceiling(curve, 1):.2f}x of none's, every draft "
              "accepted (`ceiling`; several clients: bench.bench_verify_cost)")
    if curve.get("payoff"):  # engine.spec.planner: got / planned per batch size, scaling that size's later plans
        print("how its plans came true by the end of its first round (payoff per batch size of decode rows, the "
              "factor on later plans' expected rates): " + ", ".join(f"{k}: {float(v):.2f}"
                                                                       for k, v in curve["payoff"].items()))
