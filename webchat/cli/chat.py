"""`webchat chat`: a terminal chat that streams each reply; Ctrl-C stops the reply, not the program."""

from __future__ import annotations

import argparse
import signal
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, TextIO

from webchat.engine.events import Stats
from webchat.engine.generator import Generator
from webchat.engine.sequence import GenerationRequest
from webchat.engine.settings import SamplingSettings, SettingsError
from webchat.engine.spec.drafters import MODES
from webchat.model.weights import add_precision_argument, precision_of

if TYPE_CHECKING:
    from webchat.text.tokenizer import Tokenizer


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", type=Path, default=None, help="folder or .gguf (default: the pulled SmolLM2)")
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--system", default=None, help="system prompt")
    parser.add_argument("--max-new-tokens", type=int, default=512)
    parser.add_argument("--context", type=int, default=None, help="KV cache size (default: the model's)")
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--top-k", type=int, default=40)
    parser.add_argument("--top-p", type=float, default=0.95)
    parser.add_argument("--min-p", type=float, default=0.05)
    parser.add_argument("--repetition-penalty", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--speculative", default="auto", choices=[m for m in MODES if m != "draft"],
                        help="auto (default): draft where it pays, measured here; none: never")
    parser.add_argument("--stats", action="store_true", help="print tokens/s and timings after each reply")
    add_precision_argument(parser)


@contextmanager
def ctrl_c_cancels(gen: Generator) -> Iterator[None]:
    """While a reply streams, SIGINT asks the generator to stop at its next step instead of raising."""

    def handler(signum: int, frame: FrameType | None) -> None:
        gen.cancel()

    previous = signal.signal(signal.SIGINT, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def reply(gen: Generator, request: GenerationRequest, out: TextIO) -> tuple[str, str | None, Stats | None]:
    """Stream one reply to `out`; returns its text, the end reason and the stats."""
    text = ""
    gen.begin_stream(request)
    with ctrl_c_cancels(gen):
        while True:
            res = gen.stream()
            if res.text:
                out.write(res.text)
                out.flush()
                text += res.text
            if res.eos:
                return text, res.eos_reason, res.stats


def main(args: argparse.Namespace) -> int:
    from webchat.files.folder_check import check_model_folder
    from webchat.files.gguf_cache import model_folder
    from webchat.files.pull import ensure_default_model
    from webchat.kernels.backend import load_model
    from webchat.model.loader import resolve_device, resolve_dtype
    from webchat.text.tokenizer import Tokenizer

    try:
        settings = SamplingSettings(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                                    min_p=args.min_p, repetition_penalty=args.repetition_penalty, seed=args.seed)
    except SettingsError as e:
        print(f"webchat chat: {e}", file=sys.stderr)
        return 2
    path = model_folder(args.model) if args.model else ensure_default_model()  # a .gguf: converted once
    check_model_folder(path)  # config and tokenizer, before the weights load
    device = resolve_device(args.device)
    model = load_model(path, device, resolve_dtype(None, device), precision=precision_of(args))
    tok = Tokenizer.from_dir(path)
    gen = Generator(model, tok, max_seq_len=args.context)
    if args.speculative == "auto":
        gen.engine.calibrate()  # what verify rows cost here, before the first reply waits on it
    print(f"webchat chat — {path.name} on {device}. /reset starts over, /quit or Ctrl-D leaves, "
          "Ctrl-C stops a reply.", file=sys.stderr)
    return loop(gen, tok, settings, args, sys.stdin, sys.stdout)


def loop(gen: Generator, tok: Tokenizer, settings: SamplingSettings, args: argparse.Namespace, inp: TextIO,
         out: TextIO) -> int:
    system = [{"role": "system", "content": args.system}] if args.system else []
    messages: list[dict[str, str]] = list(system)
    while True:
        out.write("\n> ")
        out.flush()
        try:
            line = inp.readline()
        except KeyboardInterrupt:
            out.write("\n")
            return 0
        if not line or line.strip() == "/quit":
            return 0
        if line.strip() == "/reset":
            messages = list(system)
            continue
        if not line.strip():
            continue
        messages.append({"role": "user", "content": line.rstrip("\n")})
        ids = tok.encode_chat(messages)  # typed control markers stay text
        room = gen.capacity - len(ids)
        if room < 1:
            out.write(f"[the conversation is {len(ids)} tokens; the context holds {gen.capacity}: /reset]\n")
            messages.pop()
            continue
        request = GenerationRequest(prompt_ids=ids, settings=settings, max_new_tokens=min(args.max_new_tokens, room),
                                    speculative=args.speculative)
        text, reason, stats = reply(gen, request, out)
        messages.append({"role": "assistant", "content": text})
        if reason != "stop_token":
            out.write(f"\n[{reason}]")
        if args.stats and stats is not None:
            out.write(f"\n[{stats.new_tokens} tokens, {stats.decode_tps:.1f} tok/s, ttft {stats.ttft_ms:.0f} ms, "
                      f"reused {stats.reused_tokens}/{stats.prompt_tokens} prompt tokens, "
                      f"accepted {stats.accepted}/{stats.drafted} drafts]")
        out.write("\n")
