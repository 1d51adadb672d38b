"""What `webchat serve` is told (ServerConfig) and the security rules every route applies: loopback, Origin, CSP."""

from __future__ import annotations

import hashlib
import ipaddress
import re
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

PAGE = Path(__file__).resolve().parent / "page"  # the page's template and assets: inside the package, in a wheel
LOOPBACK_NAMES = {"localhost", "127.0.0.1", "::1"}


@dataclass
class ServerConfig:
    """Everything `webchat serve` is told; `create_app` reads only this."""

    model_dir: Path
    mmproj: Path | None = None  # the model's projector GGUF (--mmproj): it reads images (webchat.serve.images)
    mmproj_precision: str = "exact"  # the vision encoder's matmuls: exact (float32) or int8 (docs/vision.md)
    image_max_tiles: int = 4  # an image's tiles at most, unless a request asks (webchat.serve.images)
    draft_dir: Path | None = None
    speculative: str = "auto"  # the mode for requests that name none
    device: str = "auto"
    dtype: str | None = None  # None: float32 on the CPU, float16 on CUDA
    weights: str = "auto"  # webchat.model.loader.WEIGHTS: the folder's quantized blocks on the CPU where present
    quantize: str | None = None  # q8_0 | q4_0: quantize float weights at load
    threads: int | None = None  # the device's OpenMP team; None: the cores, fewer while other processes use them
    exact: bool = False  # --exact: float32 activations for the quantized matrices (default: the faster, docs/quant.md)
    host: str = "127.0.0.1"
    port: int = 8000
    max_sessions: int = 64  # connections whose KV pages are kept between turns (idle ones cost only their pages)
    max_queue: int = 16
    stream_interval: float = 0.04  # seconds: a stream's tokens go out at most this often while they come faster
    reasoning_budget: int | None = None  # thinking tokens before the end of thinking is forced; None: unbounded
    allow_origins: tuple[str, ...] = ()
    max_seq_len: int | None = None  # cap on the context (KV-cache memory per session)
    max_message_bytes: int = 1 << 20
    kv_pool: str | None = None  # KV pool size: tokens or "512MiB"; None: 1 GiB on the CPU, half the free GPU memory
    kv_cache: str | None = None  # how the pool stores k and v (webchat.model.kv_format); None: f32 (the model's dtype)
    max_pending_bytes: int = 1 << 20  # a connection's output not yet written; past it the server stops reading it
    stall_timeout: float = 30.0  # seconds output may stay past max_pending_bytes before the socket is closed
    max_connections: int | None = None  # None: a quarter of the file limit (webchat.serve.limits)
    handshake_timeout: float = 10.0  # seconds a socket has to finish its first HTTP request
    trusted_hosts: tuple[str, ...] | None = None  # Host names HTTP routes answer; None: any (`serve` sets loopback)
    access_token: str | None = None  # when set, every route needs it (webchat.serve.limits.TokenCheck)
    api_key: str | None = None  # when set, the OpenAI API (/v1) needs `Authorization: Bearer <key>`
    models_dir: Path | None = None  # more models to serve beside model_dir (webchat.serve.models); None: that one
    max_models: int = 2  # models loaded at once; the least recently used idle one is unloaded first
    memory_budget: int | None = None  # bytes the loaded models' estimates may take; None: 80% of the RAM
    engine_url: str | None = None  # generate on this OpenAI-compatible upstream (serve/remote), no local model
    engine_model: str | None = None  # the upstream's model (default: the first it lists)
    engine_key: str | None = None  # sent upstream as Authorization: Bearer; never shown
    engine_timeout: float = 60.0  # seconds the upstream may send nothing before the request fails
    engine_affinity_header: str | None = None  # also send the conversation key in this header (routers' affinity)
    mcp_config: Path | None = None  # the MCP servers' file (webchat.mcp.config): the only place servers are defined
    mcp_result_chars: int = 16_000  # a tool result's text is cut there, with a note
    templates_dir: Path = PAGE / "templates"
    static_dir: Path = PAGE / "static"


# ---------------------------------------------------------------- security
def is_loopback(host: str) -> bool:
    host = host.strip("[]")
    if host in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def origin_allowed(origin: str | None, host_header: str | None, config: ServerConfig) -> bool:
    """Same origin as the page (scheme://Host), or listed in --allow-origin. No Origin: not a browser, allowed.

    Bound to loopback, the Host must also name a loopback address, so a DNS-rebinding page cannot pass as same-origin.
    """
    if origin is None:
        return True
    if origin in config.allow_origins:
        return True
    if host_header is None or origin.lower() not in (f"http://{host_header}".lower(), f"https://{host_header}".lower()):
        return False
    return not is_loopback(config.host) or is_loopback(urlsplit(origin).hostname or "")


_SAFE_HOST = re.compile(r"^[A-Za-z0-9.\-:\[\]]{1,255}$")


def content_security_policy(host_header: str | None) -> str:
    """No inline script anywhere; the websocket may go back to the page's own host."""
    ws = f" ws://{host_header} wss://{host_header}" if host_header and _SAFE_HOST.match(host_header) else ""
    return ("default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
            f"connect-src 'self'{ws}; object-src 'none'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'")


def static_version(static_dir: Path) -> str:
    """A short hash of the static files' names, sizes and mtimes, for cache-busting query strings."""
    digest = hashlib.sha256()
    if static_dir.is_dir():
        for path in sorted(static_dir.rglob("*")):
            if path.is_file():
                st = path.stat()
                digest.update(f"{path.relative_to(static_dir)}:{st.st_size}:{st.st_mtime_ns};".encode())
    return digest.hexdigest()[:12]
