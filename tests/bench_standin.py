"""A stand-in for `webchat serve` and `llama-server` in tests/repo/test_bench_served.py: the endpoints
bench.bench_served reads (ready paths, /v1/models, /api/info, streamed chat completions with usage), no model.

    python bench_standin.py serve --help | serve --port P [--exact] ...   # as `python -m webchat.cli serve`
    python bench_standin.py llama --port P ...                            # as llama-server

`serve` appends its arguments to served.txt in its working folder (the checkout it is served from).
STANDIN_EXACT=1 makes `serve` take --exact and report `precision` in /api/info ("exact" with it, "int8" without), as
issue 38's precision choice does; without it, `serve` has no --exact and /api/info no precision (the checkout before).
"""

from __future__ import annotations

import json
import os
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

TOKEN_S = 0.002  # a token's time


def handler(info: dict[str, object]) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - the base class's name
            pass

        def send_json(self, body: object) -> None:
            data = json.dumps(body).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:  # noqa: N802 - the base class's name
            if self.path in ("/health", "/healthz"):
                self.send_json({"status": "ok"})
            elif self.path == "/v1/models":
                self.send_json({"data": [{"id": "standin"}]})
            elif self.path == "/api/info":
                self.send_json(info)
            else:
                self.send_error(404)

        def do_POST(self) -> None:  # noqa: N802
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            prompt = sum(len(m["content"].split()) for m in body["messages"])
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            for _ in range(body["max_tokens"]):
                time.sleep(TOKEN_S)
                self.wfile.write(b"data: " + json.dumps({"choices": [{"delta": {"content": "x"}}]}).encode() + b"\n\n")
                self.wfile.flush()
            usage = {"completion_tokens": body["max_tokens"], "prompt_tokens": prompt}
            self.wfile.write(b"data: " + json.dumps({"choices": [], "usage": usage}).encode() + b"\n\ndata: [DONE]\n\n")

    return Handler


def main(argv: list[str]) -> None:
    exact_flag = os.environ.get("STANDIN_EXACT") == "1"
    if argv[:2] == ["serve", "--help"]:
        print("usage: webchat serve [--model MODEL] [--port PORT]" + (" [--exact]" if exact_flag else ""))
        return
    if "--exact" in argv and not exact_flag:
        sys.exit("webchat serve: error: unrecognized arguments: --exact")
    if argv[0] == "serve":  # run from inside the checkout: its arguments noted there, a line a server
        with open("served.txt", "a") as f:
            f.write(" ".join(argv) + "\n")
    info: dict[str, object] = {"model": "standin"}
    if argv[0] == "serve" and exact_flag:
        info["precision"] = "exact" if "--exact" in argv else "int8"
    port = int(argv[argv.index("--port") + 1])
    ThreadingHTTPServer(("127.0.0.1", port), handler(info)).serve_forever()


if __name__ == "__main__":
    main(sys.argv[1:])
