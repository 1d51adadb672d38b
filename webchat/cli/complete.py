"""`webchat complete "prompt"`: one greedy completion of a chat message, printed when it is done."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from webchat.model.weights import add_weight_arguments, precision_of


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prompt", help="the user message")
    parser.add_argument("--model", type=Path, default=None, help="folder or .gguf (default: the pulled SmolLM2)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    add_weight_arguments(parser)


def main(args: argparse.Namespace) -> int:
    """`webchat complete`: chat-template the prompt, then greedy-decode through the KV cache."""

    from webchat.files.folder_check import check_model_folder
    from webchat.files.gguf_cache import model_folder
    from webchat.files.pull import ensure_default_model
    from webchat.kernels.backend import load_model
    from webchat.model.loader import resolve_device, resolve_dtype
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
