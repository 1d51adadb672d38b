"""`webchat pull [--force]`: fetch and convert the default model (idempotent, atomic), print where it is."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from webchat.files.home import default_gguf_path
from webchat.files.pull import PullError, ensure_default_gguf, ensure_default_model


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--home", type=Path, default=None, help="cache folder (default: $WEBCHAT_HOME or ~/.cache/webchat)"
    )
    parser.add_argument("--force", action="store_true", help="download and convert again even if already done")


def main(args: argparse.Namespace) -> int:
    """`webchat pull`: make sure the default model is converted and print where it is."""
    try:
        path = ensure_default_model(args.home, force=args.force)
        ensure_default_gguf(args.home, verify=True)
    except PullError as exc:
        print(f"webchat pull: {exc}", file=sys.stderr)
        return 1
    print(f"model: {path}")
    print(f"gguf:  {default_gguf_path(args.home)}")
    return 0
