"""`webchat serve`: the Starlette app (page, static files, info, websocket) over one model and one GPU worker."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Mount, Route, WebSocketRoute
from starlette.staticfiles import StaticFiles
from starlette.templating import Jinja2Templates
from starlette.websockets import WebSocket

from webchat.serve.backend import Backend
from webchat.serve.config import ServerConfig, content_security_policy, origin_allowed, static_version
from webchat.serve.device import DeviceThread
from webchat.serve.limits import (
    AcceptErrorLog,
    ConnectionGuard,
    HostCheck,
    TokenCheck,
    default_max_connections,
)
from webchat.serve.models import Card, Fleet, Models, scan
from webchat.serve.openai.routes import OpenAIApi
from webchat.serve.runtime import (
    RemoteRuntime,
    Runtime,
    load_remote_runtime,
    load_runtime,
    warm_up,
)
from webchat.serve.worker import Worker
from webchat.serve.ws import Connection

if TYPE_CHECKING:
    from webchat.serve.toolhub import ToolHub

log = logging.getLogger("webchat.serve.app")

# ---------------------------------------------------------------- the app
def _models(config: ServerConfig, rt: Runtime, device: DeviceThread) -> Models:
    """The catalog (the loaded default, --models-dir) and its Fleet of workers on `device`."""
    loop = asyncio.get_running_loop()

    def make_worker(r: Runtime) -> Worker:
        _, tokenizer, engine = r.local()
        return Worker(engine, tokenizer.id_to_text, loop, config.max_sessions, config.max_queue, device=device,
                      stream_interval=config.stream_interval)

    try:
        cards = scan(config.model_dir, config.models_dir)
        first = next(iter(cards.values()))
        # a .gguf's cache folder: the name the runtime serves it under; its projector: --mmproj's
        default = dataclasses.replace(first, name=rt.model_name, projector=config.mmproj)
        cards = {rt.model_name: default, **{k: v for k, v in cards.items() if k not in (first.name, rt.model_name)}}
    except (OSError, ValueError) as exc:  # a runtime handed in without its folder (tests): described from itself
        log.info("the default model's folder is not described (%s); serving it alone", exc)
        cards = {rt.model_name: Card(rt.model_name, config.model_dir, 0, "unknown", rt.weights, rt.context_length,
                                     default=True)}
    models = Models(cards, config, Fleet(device, rt.model_name), make_worker, config.max_models,
                    config.memory_budget)
    models.attach(rt)
    return models



def create_app(config: ServerConfig, runtime: Runtime | None = None) -> Starlette:
    """The app; its lifespan loads the model (unless `runtime` is given) and starts the worker."""

    templates = Jinja2Templates(directory=str(config.templates_dir))
    version = static_version(config.static_dir)
    guard = ConnectionGuard(config.max_connections or default_max_connections(), config.handshake_timeout)
    api = OpenAIApi(config)

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[dict[str, Any]]:
        worker: Backend
        models: Models | None = None
        if runtime is None and config.engine_url is not None:
            remote = await load_remote_runtime(config)
            rt: Runtime = remote
            worker = remote.remote()
        else:
            device = DeviceThread(config.threads)  # the one thread that loads, warms and steps (serve.device)
            device.start()
            try:
                rt = runtime if runtime is not None else await device.run(lambda: warm_up(load_runtime(config)))
            except BaseException:
                device.stop()
                raise
            if isinstance(rt, RemoteRuntime):
                device.stop()
                worker = rt.remote()
            else:
                models = _models(config, rt, device)
                worker = models.fleet
        worker.start()
        try:
            tools = await _start_tools(config, rt)
        except BaseException:
            worker.stop()
            raise
        loop = asyncio.get_running_loop()
        previous_handler = loop.get_exception_handler()
        loop.set_exception_handler(AcceptErrorLog())
        if isinstance(rt, RemoteRuntime) and runtime is None:
            caps = rt.remote().caps
            print(f"webchat: generation on {caps.url} ({caps.kind}, {caps.state}"
                  f"{': ' + caps.error if caps.error else ''}) ready at {display_url(config)}", flush=True)
        elif runtime is None:
            print(f"webchat: {rt.model_name} on {rt.device} ({rt.dtype}, weights {rt.weights}) ready at "
                  f"{display_url(config)}", flush=True)
        try:
            yield {"runtime": rt, "worker": worker, "config": config, "models": models, "tools": tools}
        finally:
            loop.set_exception_handler(previous_handler)
            if tools is not None:
                await tools.manager.stop()  # every server's process stopped, in the task that started them
            api.close()
            worker.stop()
            if isinstance(rt, RemoteRuntime):
                await rt.remote().aclose()

    async def index(request: Request) -> Response:
        rt: Runtime = request.state.runtime
        context = {"model_name": rt.model_name, "context_length": rt.context_length, "static_version": version}
        response = templates.TemplateResponse(request, "index.html", context)
        _secure_headers(response, request.headers.get("host"))
        return response

    async def info(request: Request) -> Response:
        rt: Runtime = request.state.runtime
        body = rt.hello().model_dump(exclude={"type"})
        if request.state.models is not None:
            body["models"] = request.state.models.wire()
        snap = request.state.worker.snapshot()
        body.update(max_sessions=config.max_sessions, max_queue=config.max_queue, default_speculative=rt.default_mode,
                    active=len(snap.active), queued=len(snap.pending))
        if rt.engine is not None:
            body["kv_pool"] = rt.engine.pool_info()
            body["speculation"] = rt.engine.auto.info()  # the auto mode's cost curve and decisions
        if rt.device == "cpu":
            from webchat.kernels.cpu.build import running

            body["cpu_kernels"] = running()  # {"path": "avx2", "vnni": false}; None: float32 PyTorch ops
        if request.state.models is not None:
            body["device_threads"] = request.state.models.fleet.device.team()  # webchat.serve.cores
        return JSONResponse(body)

    async def healthz(request: Request) -> Response:
        snap = request.state.worker.snapshot()
        pool = request.state.runtime.engine.pool_info() if request.state.runtime.engine is not None else None
        return JSONResponse({"status": "ok", "active": len(snap.active), "queued": len(snap.pending),
                             "sessions": snap.sessions, "kv_pool": pool})

    async def ws_endpoint(websocket: WebSocket) -> None:
        origin, host = websocket.headers.get("origin"), websocket.headers.get("host")
        if not origin_allowed(origin, host, config):
            log.warning("refused a websocket from origin %r (host %r)", origin, host)
            await _refuse(websocket, f"origin {origin!r} is not allowed; serve the page from this server "
                                     "or pass --allow-origin")
            return
        await websocket.accept()
        conn = Connection(websocket, websocket.state.runtime, websocket.state.worker, config, guard,
                          websocket.state.models, websocket.state.tools)
        await conn.serve()

    routes = [
        Route("/", index),
        Route("/api/info", info),
        Route("/healthz", healthz),
        WebSocketRoute("/ws", ws_endpoint),
        *api.routes(),
        Mount("/static", StaticFiles(directory=str(config.static_dir), check_dir=False), name="static"),
    ]
    app = Starlette(routes=routes, lifespan=lifespan)
    app.state.guard = guard  # `serve` hands it to uvicorn's protocols (webchat.serve.limits)
    if config.trusted_hosts is not None:
        app.add_middleware(HostCheck, allowed=config.trusted_hosts)
    if config.access_token:
        app.add_middleware(TokenCheck, token=config.access_token, skip_prefix="/v1" if config.api_key else None)
    app.state.openai = api
    return app


async def _start_tools(config: ServerConfig, rt: Runtime) -> ToolHub | None:
    """The --mcp-config servers started (each connects in the background); None without the flag. The MCP SDK is
    imported only here."""
    if config.mcp_config is None:
        return None
    from webchat.mcp.config import load_config
    from webchat.mcp.manager import McpManager
    from webchat.serve.toolhub import ToolHub

    manager = McpManager(load_config(config.mcp_config))
    await manager.start()
    names = ", ".join(f"{s.name} ({s.transport})" for s in manager.config.servers) or "none"
    print(f"webchat: MCP servers from {config.mcp_config}: {names}", flush=True)
    tokenizer = rt.tokenizer
    count = None if tokenizer is None else (lambda text: len(tokenizer.encode_text(text)))
    return ToolHub(manager, config.mcp_result_chars, count)


def _secure_headers(response: Response, host: str | None) -> None:
    response.headers["Content-Security-Policy"] = content_security_policy(host)
    response.headers["X-Content-Type-Options"] = "nosniff"
    response.headers["Referrer-Policy"] = "no-referrer"
    response.headers["X-Frame-Options"] = "DENY"


async def _refuse(websocket: WebSocket, message: str) -> None:
    """403 before the handshake completes (a close before accept is a 403 in uvicorn too)."""
    if "websocket.http.response" in websocket.scope.get("extensions", {}):
        await websocket.send_denial_response(PlainTextResponse(message, status_code=403))
    else:
        await websocket.close(code=1008)


def display_url(config: ServerConfig) -> str:
    host = config.host
    if host in ("0.0.0.0", "::", ""):
        host = "127.0.0.1"
    if ":" in host:
        host = f"[{host}]"
    return f"http://{host}:{config.port}/"
