"""A vision model served, webchat against llama-server `--mmproj` on the same two files (the text GGUF and its
mmproj-f16), in one run, rounds alternating which server goes first (issue 61's acceptance):

- cold: time to first token of a chat about a new 2048 x 512 image (SmolVLM: 5 tiles, 320 image tokens; Gemma 3:
  one image, 256), streamed through /v1/chat/completions; a fresh image each round, so neither server has it cached;
- next turn: the same conversation one turn on (the image sent again, an answer and a new question): TTFT;
- decode tok/s of the reply after the image, beside a text-only reply of the same length (end of turn biased away)
  after a short prompt, and after a text prompt as long as the image's (the same depth: what the image itself costs);
- peak RSS of each server process over the run.

Targets: cold <= 0.5x llama-server's, the next turn <= 0.1x webchat's cold, decode after the image within 5% of the
text-only reply's. The fixtures are built first if missing (bench.vision_fixtures).

Usage: python -m bench.bench_vision_served [--fixture smolvlm gemma3] [--rounds 3] [--tokens 48] [--llama PATH]
"""

from __future__ import annotations

import argparse
import base64
import io
import os
import statistics
from pathlib import Path
from typing import Any

from bench import vision_fixtures
from bench.common import (
    Server,
    Stream,
    find_llama_server,
    free_port,
    llama_server,
    stop_token_ids,
    table_header,
    table_row,
    webchat_server,
)
from bench.vision_fidelity import picture

QUESTION = "What is in this picture?"
FOLLOW_UP = "And which colours does it have?"
TEXT_ONLY = "Tell me about the history of the bicycle."
# about as many tokens as the image prompt (SmolVLM's 346, Gemma 3's 277): decode at the image reply's depth
DEEP_TEXT = "Here are some notes on bicycles, wheels, frames and gears. " * 26 + TEXT_ONLY


def data_url(seed: int) -> str:
    buf = io.BytesIO()
    picture(2048, 512, seed).save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def first_turn(url: str) -> list[dict[str, Any]]:
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                         {"type": "text", "text": QUESTION}]}]


def next_turn(url: str) -> list[dict[str, Any]]:
    return [*first_turn(url), {"role": "assistant", "content": "A picture of stripes and gradients."},
            {"role": "user", "content": FOLLOW_UP}]


def servers(fx: vision_fixtures.Fixture, llama: Path) -> list[Server]:
    stops = stop_token_ids(fx.text_gguf)
    ours = webchat_server(free_port(), fx.text_gguf, "--mmproj", str(fx.mmproj_f16), "--speculative", "none",
                          stops=stops)
    theirs = llama_server(llama, fx.text_gguf, free_port(), 4096, 1, "--mmproj", str(fx.mmproj_f16))
    return [ours, theirs]


def one_round(server: Server, seed: int, tokens: int) -> dict[str, Stream]:
    url = data_url(seed)
    return {"cold": server.stream(first_turn(url), tokens),  # type: ignore[arg-type]
            "next": server.stream(next_turn(url), tokens),  # type: ignore[arg-type]
            "text": server.stream([{"role": "user", "content": TEXT_ONLY}], tokens),  # type: ignore[arg-type]
            "deep": server.stream([{"role": "user", "content": DEEP_TEXT}], tokens)}  # type: ignore[arg-type]


def run(name: str, rounds: int, tokens: int, llama: Path) -> list[list[str]]:
    fx = vision_fixtures.build(name)
    found: dict[str, list[dict[str, Stream]]] = {"webchat": [], "llama-server": []}
    pair = servers(fx, llama)
    try:
        for s in pair:
            s.wait_ready(1800)
        for r in range(rounds):
            order = pair if r % 2 == 0 else pair[::-1]
            for s in order:
                got = one_round(s, 1000 * (r + 1) + len(name), tokens)
                found[s.name].append(got)
                print(f"  {name} round {r + 1} {s.name}: cold {got['cold'].ttft_ms / 1000:.2f} s, next "
                      f"{got['next'].ttft_ms / 1000:.2f} s, decode {got['cold'].decode_tps:.1f} / text "
                      f"{got['text'].decode_tps:.1f} tok/s, at the same depth {got['deep'].decode_tps:.1f} "
                      f"({got['deep'].prompt_tokens} prompt tokens), prompt {got['cold'].prompt_tokens} tokens",
                      flush=True)
    finally:
        for s in pair:
            s.stop()
    rss = {s.name: s.peak_rss for s in pair}
    rows = []
    cold = {k: statistics.median(g["cold"].ttft_ms for g in v) / 1000 for k, v in found.items()}
    for who, got in found.items():
        med = {k: statistics.median(getattr(g[k], f) for g in got) for k, f in
               (("cold", "ttft_ms"), ("next", "ttft_ms"))}
        after = statistics.median(g["cold"].decode_tps for g in got)
        text = statistics.median(g["text"].decode_tps for g in got)
        deep = statistics.median(g["deep"].decode_tps for g in got)
        rows.append([name, who, str(got[0]["cold"].prompt_tokens), f"{med['cold'] / 1000:.2f}",
                     " / ".join(f"{g['cold'].ttft_ms / 1000:.2f}" for g in got),
                     f"{cold[who] / cold['llama-server']:.2f}x", f"{med['next'] / 1000:.3f}",
                     f"{med['next'] / med['cold']:.3f}x", f"{after:.1f}", f"{text:.1f}", f"{after / text - 1:+.1%}",
                     f"{deep:.1f}", f"{after / deep - 1:+.1%}",
                     f"{rss[who] / (1 << 20):.0f}"])
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--fixture", nargs="+", default=["smolvlm", "gemma3"], choices=list(vision_fixtures.SPECS))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--llama", type=Path, default=None,
                        help="llama-server (default: bench/build_llama_server.sh's)")
    args = parser.parse_args()
    llama = find_llama_server(args.llama)
    before = os.getloadavg()
    rows = [row for name in args.fixture for row in run(name, args.rounds, args.tokens, llama)]
    print(f"\nload average before {before[0]:.1f}, after {os.getloadavg()[0]:.1f} (1 min); {args.rounds} rounds "
          f"alternating, medians; {args.tokens} tokens a reply")
    print(table_header("fixture", "server", "prompt tokens", "cold TTFT s", "rounds", "cold vs llama-server",
                       "next turn TTFT s", "next / cold", "decode after image tok/s", "text-only tok/s",
                       "after vs text", "text at its depth tok/s", "after vs same depth", "peak RSS MiB",
                       align="llrrrrrrrrrrrr"))
    for row in rows:
        print(table_row(*row))


if __name__ == "__main__":
    main()
