"""`webchat serve`: its flags, the server config they make, and the start-up checks before uvicorn runs the app."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from pathlib import Path

import uvicorn

from webchat.engine.spec.drafters import MODES
from webchat.model.weights import add_weight_arguments
from webchat.serve.app import create_app
from webchat.serve.config import LOOPBACK_NAMES, ServerConfig, is_loopback
from webchat.serve.limits import default_max_connections, guarded_protocols


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", type=Path, default=None, help="folder or .gguf (default: the pulled SmolLM2)")
    parser.add_argument("--mmproj", type=Path, default=None, metavar="FILE",
                        help="the model's projector GGUF (llama.cpp's mmproj-*.gguf: SmolVLM, Gemma 3): the model then "
                        "reads images (docs/vision.md); in --models-dir an mmproj*.gguf beside a model pairs with it")
    parser.add_argument("--mmproj-precision", default="exact", choices=["exact", "int8"],
                        help="the vision encoder's matmuls: exact (float32, the faster on AMX) or int8 (default exact)")
    parser.add_argument("--image-max-tiles", type=_positive, default=4, metavar="N",
                        help="an image's tiles at most, unless a request asks for others (default 4: a square photo "
                        "is 2 x 2 tiles and an overview, encoded in seconds on two cores; at most 36)")
    parser.add_argument("--models-dir", type=Path, default=None, metavar="DIR",
                        help="serve every model folder and .gguf in DIR too, each loaded on first use (default: "
                        "$WEBCHAT_HOME/models, where `webchat pull` puts the default)")
    parser.add_argument("--max-models", type=_positive, default=2,
                        help="models loaded at once; the least recently used idle one is unloaded first (default 2)")
    parser.add_argument("--memory-budget", default=None, metavar="SIZE",
                        help="memory the loaded models may take, by their estimates (weights + KV pool), e.g. 8GiB; "
                        "a model over it is refused before loading (default: 80%% of the RAM)")
    parser.add_argument("--draft", type=Path, default=None, help="draft model folder for speculative mode 'draft'")
    parser.add_argument("--speculative", default="auto", choices=list(MODES),
                        help="the speculative mode for requests that name none (default: auto, which drafts only where "
                        "the drafts pay for their verify rows, measured at start-up; none: never draft; self, ngram, "
                        "draft: always draft 4 tokens that way)")
    parser.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"])
    parser.add_argument("--dtype", default=None, choices=["float32", "float16", "bfloat16"],
                        help="default: float32 on the CPU, float16 on CUDA")
    add_weight_arguments(parser)
    parser.add_argument("--threads", type=_positive, default=None,
                        help="CPU threads for the model (default: every core, one fewer for each core other "
                        "processes keep busy, followed as the load changes)")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1, this machine only)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--max-sessions", type=_positive, default=64,
                        help="connections whose KV pages are kept between turns (default 64)")
    parser.add_argument("--kv-pool", default=None, metavar="SIZE",
                        help="KV pool: tokens (32768) or memory (512MiB, 2GiB); default 1GiB on the CPU, half the "
                             "free memory on a GPU")
    parser.add_argument("--kv-cache", default=None, choices=["f32", "f16", "q8_0"],
                        help="how the KV cache stores k and v, llama.cpp's names (default f32; f16: half the bytes, "
                        "q8_0: 17/64 of them; docs/api.md, \"The KV cache\"). CPU only: on CUDA the pool is in --dtype")
    parser.add_argument("--max-queue", type=_non_negative, default=16, help="requests waiting past that (default 16)")
    parser.add_argument("--stream-interval-ms", type=_non_negative, default=round(ServerConfig.stream_interval * 1000),
                        metavar="MS", help="send a stream's tokens at most this often while they come faster, several "
                        "in one message (default %(default)s; 0: every step)")
    parser.add_argument("--reasoning-budget", type=_budget, default=-1, metavar="N",
                        help="thinking tokens a reply may write before the end of thinking is forced, as "
                        "llama-server's (default -1: unbounded; 0: none); a request may set its own")
    parser.add_argument("--allow-origin", action="append", default=[], metavar="ORIGIN",
                        help="another page origin allowed to open the websocket, e.g. http://localhost:3000")
    parser.add_argument("--max-seq-len", type=_positive, default=None,
                        help="cap the context (and the KV-cache memory of each session); default: the model's")
    parser.add_argument("--max-connections", type=_positive, default=None,
                        help="open sockets at most (default: a quarter of the open-file limit, "
                        f"{default_max_connections()} here)")
    parser.add_argument("--handshake-timeout", type=float, default=10.0,
                        help="seconds a socket has to finish its first HTTP request (default 10)")
    parser.add_argument("--access-token", default=os.environ.get("WEBCHAT_TOKEN"),
                        help="require this token on every route (open the page as /?token=TOKEN; API clients send "
                        "'Authorization: Bearer TOKEN'); default: $WEBCHAT_TOKEN")
    parser.add_argument("--stall-timeout", type=float, default=30.0,
                        help="seconds a websocket may leave 1 MiB of replies unread before it is closed (default 30)")
    parser.add_argument("--api-key", default=os.environ.get("WEBCHAT_API_KEY"),
                        help="require 'Authorization: Bearer KEY' on the OpenAI API (/v1); default: $WEBCHAT_API_KEY")
    parser.add_argument("--engine-url", default=None, metavar="URL",
                        help="generate on this OpenAI-compatible engine (vLLM, SGLang, llama.cpp's server, another "
                        "webchat), e.g. http://127.0.0.1:8001; the local model is not loaded (docs/scale-out.md)")
    parser.add_argument("--engine-model", default=None, metavar="NAME",
                        help="the upstream's model (default: the first its /v1/models lists)")
    parser.add_argument("--engine-key", default=os.environ.get("WEBCHAT_ENGINE_KEY"), metavar="KEY",
                        help="API key sent to the upstream engine; default: $WEBCHAT_ENGINE_KEY")
    parser.add_argument("--engine-timeout", type=float, default=60.0,
                        help="seconds the upstream may go without a complete event (or send nothing) before a request "
                        "fails (default 60)")
    parser.add_argument("--engine-affinity-header", default=None, metavar="NAME",
                        help="also send each conversation's stable key in this header (e.g. x-session-id) for a "
                        "router's session affinity; it always goes in the body's 'user' field")
    parser.add_argument("--mcp-config", type=Path, default=None, metavar="FILE",
                        help="start the MCP servers this file names (the mcpServers form of Claude Desktop, Cursor and "
                        "LM Studio) and offer their tools in the page; only this file defines servers (docs/tools.md)")
    parser.add_argument("--mcp-result-chars", type=_positive, default=16_000, metavar="N",
                        help="a tool result's text is cut to N characters, with a note (default 16000)")


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {value}")
    return value


def _budget(text: str) -> int:
    value = int(text)
    if value < -1:
        raise argparse.ArgumentTypeError(f"expected -1 (unbounded) or a count of tokens >= 0, got {value}")
    return value


def _non_negative(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {value}")
    return value


def parse_size(text: str) -> int:
    """'8GiB', '512MiB' or a byte count, as bytes; ValueError naming the value otherwise."""
    from webchat.model.kv_cache import size_bytes

    nbytes = size_bytes(text)
    if nbytes is not None:
        return nbytes
    value = text.strip().replace(" ", "")
    if value.isdigit() and int(value) > 0:
        return int(value)
    raise ValueError(f"--memory-budget must be a size like 8GiB or 512MiB (or bytes), got {text!r}")


def config_from_args(args: argparse.Namespace, model_dir: Path) -> ServerConfig:
    return ServerConfig(model_dir=model_dir, draft_dir=args.draft, speculative=args.speculative, device=args.device,
                        dtype=args.dtype, host=args.host, port=args.port, max_sessions=args.max_sessions,
                        max_queue=args.max_queue, stream_interval=args.stream_interval_ms / 1000,
                        reasoning_budget=None if getattr(args, "reasoning_budget", -1) < 0 else args.reasoning_budget,
                        allow_origins=tuple(args.allow_origin), max_seq_len=args.max_seq_len,
                        max_connections=args.max_connections, handshake_timeout=args.handshake_timeout,
                        stall_timeout=args.stall_timeout, access_token=args.access_token,
                        trusted_hosts=tuple(sorted(LOOPBACK_NAMES)) if is_loopback(args.host) else None,
                        kv_pool=args.kv_pool, kv_cache=getattr(args, "kv_cache", None), api_key=args.api_key,
                        weights=args.weights, quantize=args.quantize,
                        exact=args.exact, threads=args.threads,
                        engine_url=getattr(args, "engine_url", None), engine_model=getattr(args, "engine_model", None),
                        engine_key=getattr(args, "engine_key", None),
                        engine_timeout=getattr(args, "engine_timeout", 60.0),
                        engine_affinity_header=getattr(args, "engine_affinity_header", None),
                        models_dir=getattr(args, "models_dir", None), max_models=getattr(args, "max_models", 2),
                        memory_budget=parse_size(args.memory_budget) if getattr(args, "memory_budget", None) else None,
                        mcp_config=getattr(args, "mcp_config", None),
                        mcp_result_chars=getattr(args, "mcp_result_chars", 16_000),
                        mmproj=getattr(args, "mmproj", None),
                        mmproj_precision=getattr(args, "mmproj_precision", "exact"),
                        image_max_tiles=getattr(args, "image_max_tiles", 4),
                        max_message_bytes=message_bytes(getattr(args, "mmproj", None),
                                                        getattr(args, "models_dir", None)))


def message_bytes(mmproj: Path | None, models_dir: Path | None) -> int:
    """A frame's and a body's size limit: 1 MiB; IMAGE_MESSAGE_BYTES where a model reads images (--mmproj, or a
    projector in --models-dir), whose messages carry them as base64."""
    from webchat.serve.catalog import is_projector
    from webchat.serve.images import IMAGE_MESSAGE_BYTES

    vision = mmproj is not None
    if not vision and models_dir is not None and models_dir.is_dir():
        try:
            vision = any(is_projector(p) for entry in models_dir.iterdir()
                         for p in ([entry] if not entry.is_dir() else entry.iterdir()))
        except OSError:
            vision = False
    return IMAGE_MESSAGE_BYTES if vision else ServerConfig.max_message_bytes


def main(args: argparse.Namespace, run: Callable[..., None] = uvicorn.run) -> int:
    """Load the model and serve until Ctrl-C."""
    if args.speculative == "draft" and args.draft is None:
        print("webchat serve: --speculative draft needs --draft DIR", file=sys.stderr)
        return 2
    from webchat.serve.catalog import is_projector

    if args.model is not None and is_projector(args.model):
        print(f"webchat serve: {args.model.name} is a vision projector (mmproj), not a model: pass the model's GGUF as "
              f"--model and this one as --mmproj", file=sys.stderr)
        return 2
    if getattr(args, "mmproj", None) is not None and not args.mmproj.is_file():
        print(f"webchat serve: --mmproj {args.mmproj}: no such file", file=sys.stderr)
        return 2
    if getattr(args, "engine_url", None) is not None:
        model_dir = args.model or Path(".")  # not loaded: generation runs upstream
    elif args.model is None:
        from webchat.files.pull import ensure_default_model

        model_dir = ensure_default_model()
    else:
        from webchat.files.gguf_cache import model_folder

        model_dir = model_folder(args.model)  # a .gguf: converted once into the cache
    if getattr(args, "models_dir", None) is None and getattr(args, "engine_url", None) is None:
        from webchat.files.home import models_dir

        args.models_dir = models_dir()
    try:
        config = config_from_args(args, model_dir)
    except ValueError as exc:
        print(f"webchat serve: {exc}", file=sys.stderr)
        return 2
    if config.mcp_config is not None:
        from webchat.mcp.config import McpConfigError, load_config  # no MCP SDK import: the file is only read

        try:
            load_config(config.mcp_config)  # refused here, naming the file, the server and the field
        except McpConfigError as exc:
            print(f"webchat serve: {exc}", file=sys.stderr)
            return 2
    if not is_loopback(config.host):
        if not config.allow_origins and not config.access_token:
            print(f"webchat serve: refusing to bind to {config.host}, which is not loopback, without --allow-origin "
                  "or --access-token: anyone on the network, and any web page, could then drive the model. Name the "
                  f"page origins that may use it (e.g. --allow-origin http://{config.host}:{config.port}) or set an "
                  "access token", file=sys.stderr)
            return 2
        print(f"webchat serve: WARNING: bound to {config.host}, not loopback: anyone who can reach this machine "
              "can use the model. " + ("Only the OpenAI API (/v1) checks --api-key; the page and websocket do not."
                                       if config.api_key else "There is no authentication (see --api-key)."),
              file=sys.stderr)
    if config.engine_url is None:
        from webchat.files.folder_check import check_model_folder

        check_model_folder(model_dir)  # config and tokenizer, before the weights load
        print(f"webchat: loading {model_dir} …", flush=True)
    else:
        from webchat.serve.remote.client import Upstream

        try:
            Upstream(config.engine_url)  # the URL's shape, checked before uvicorn starts
        except ValueError as exc:
            print(f"webchat serve: {exc}", file=sys.stderr)
            return 2
        print(f"webchat: generation on {config.engine_url.split('@')[-1]} …", flush=True)
    app = create_app(config)
    from uvicorn.protocols.http.auto import AutoHTTPProtocol
    from uvicorn.protocols.websockets.websockets_sansio_impl import WebSocketsSansIOProtocol

    http, ws = guarded_protocols(app.state.guard, AutoHTTPProtocol, WebSocketsSansIOProtocol)
    try:
        run(app, host=config.host, port=config.port, http=http, ws=ws, loop="asyncio",
            backlog=min(2048, app.state.guard.max_connections), ws_max_size=4 * config.max_message_bytes,
            timeout_graceful_shutdown=3, log_level="info")
    except KeyboardInterrupt:  # uvicorn re-raises the Ctrl-C it handled, after its clean shutdown
        pass
    print("webchat: stopped", flush=True)
    return 0
