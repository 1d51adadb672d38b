"""The `webchat` command: pull the default model, serve the chat, chat in the terminal, or complete once."""

from __future__ import annotations

import argparse
import importlib
import sys

# subcommand → module with add_arguments(parser) and main(args) -> int
SUBCOMMANDS = {
    "serve": ("webchat.cli.serve", "serve the browser chat (default: the pulled SmolLM2-135M-Instruct)"),
    "chat": ("webchat.cli.chat", "chat in the terminal; Ctrl-C stops the reply, not the program"),
    "pull": ("webchat.cli.pull", "fetch and convert the default model into the cache"),
    "complete": ("webchat.cli.complete", "one greedy completion of a chat message, printed when it is done"),
}


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
