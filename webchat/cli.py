"""The `webchat` command: pull the default model, serve the chat, chat in the terminal, or complete once."""

from __future__ import annotations

import argparse
import importlib
import sys
import time
from pathlib import Path

from webchat.model.weights import add_weight_arguments, precision_of

# subcommand → module with add_arguments(parser) and main(args) -> int
SUBCOMMANDS = {
    "serve": ("webchat.serve.main", "serve the browser chat (default: the pulled SmolLM2-135M-Instruct)"),
    "chat": ("webchat.chat_cli", "chat in the terminal; Ctrl-C stops the reply, not the program"),
    "pull": ("webchat.pull", "fetch and convert the default model into the cache"),
    "complete": ("webchat.cli", "one greedy completion of a chat message, printed when it is done"),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prompt", help="the user message")
    parser.add_argument("--model", type=Path, default=None, help="folder or .gguf (default: the pulled SmolLM2)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    add_weight_arguments(parser)


def main(args: argparse.Namespace) -> int:
    """`webchat complete`: chat-template the prompt, then greedy-decode through the KV cache."""

    from webchat.folder_check import check_model_folder
    from webchat.gguf_path import model_folder
    from webchat.model.loader import load_model, resolve_device, resolve_dtype
    from webchat.pull import ensure_default_model
    from webchat.text.tokenizer import Tokenizer

    path = model_folder(args.model) if args.model else ensure_default_model()  # a .gguf: converted once
    check_model_folder(path)  # config and tokenizer, before the weights load
    device = resolve_device(args.device)
    model = load_model(path, device, resolve_dtype(None, device), weights=args.weights, quantize=args.quantize,
                       precision=precision_of(args))
    tok = Tokenizer.from_dir(path)
    ids = tok.encode_chat([{"role": "user", "content": args.prompt}])
    cache = model.new_cache(len(ids) + args.max_new_tokens)
    x, out, t0 = ids, [], time.perf_counter()
    for _ in range(args.max_new_tokens):
        nxt = int(cache.feed(model, x)[-1].argmax())
        if nxt in tok.stop_token_ids:
            break
        out.append(nxt)
        x = [nxt]
    print(tok.decode(out))
    print(f"[{len(out)} tokens in {time.perf_counter() - t0:.2f} s]", file=sys.stderr)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="webchat", description=__doc__)
    parser.add_argument("--debug", action="store_true", help="show the traceback of an error (default: one line)")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (module, help_text) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        importlib.import_module(module).add_arguments(p)
        p.set_defaults(module=module)
    return parser


def cli(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(importlib.import_module(args.module).main(args))
    except KeyboardInterrupt:
        return 130
    except Exception as exc:  # one clear line; the traceback only with --debug
        if args.debug:
            raise
        print(f"webchat {args.command}: {exc if isinstance(exc, OSError | ValueError) else repr(exc)} "
              "(--debug shows the traceback)", file=sys.stderr)
        return 1


def main_entry() -> None:
    sys.exit(cli())


if __name__ == "__main__":
    main_entry()
