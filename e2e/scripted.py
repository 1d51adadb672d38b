"""A scripted stand-in for the server's websocket (Playwright's route_web_socket): the page gets `hello`, and each
`generate` is answered by the test, token by token, in the wire format of docs/protocol.md. For rendering checks that
need a known reply (Markdown); everything about generation itself is tested against the real server."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from playwright.sync_api import Page, WebSocketRoute

HELLO = {"type": "hello", "v": 1, "model": "scripted", "context_length": 4096, "device": "cpu", "dtype": "float32",
         "speculative": ["none"], "max_alternatives": 20}


def wire_tokens(pieces: list[str]) -> list[dict[str, Any]]:
    """One wire token per piece: p cycles through 0.9 .. 0.1, two alternatives (itself first, then "?")."""
    out = []
    for i, text in enumerate(pieces):
        p = round(0.9 - 0.8 * ((i * 7) % 10) / 9, 4)
        top = [{"id": 1000 + i, "text": text, "p": p}, {"id": 5, "text": "?", "p": round((1 - p) / 2, 4)}]
        top.sort(key=lambda a: -float(a["p"]))  # type: ignore[arg-type]
        rank = 1 + [a["id"] for a in top].index(1000 + i)
        out.append({"id": 1000 + i, "text": text, "p": p, "rank": rank, "top": top})
    return out


@dataclass
class ScriptedSocket:
    """The page's /ws, answered by the test: `requests` are the generate frames the page sent."""

    page: Page
    requests: list[dict[str, Any]] = field(default_factory=list)
    route: WebSocketRoute | None = None

    def install(self) -> ScriptedSocket:
        self.page.route_web_socket("**/ws", self._accept)
        return self

    def _accept(self, ws: WebSocketRoute) -> None:
        self.route = ws
        ws.on_message(self._on_message)
        ws.send(json.dumps(HELLO))

    def _on_message(self, message: str | bytes) -> None:
        frame = json.loads(message)
        if frame.get("type") == "generate":
            self.requests.append(frame)

    def send(self, frame: dict[str, Any]) -> None:
        assert self.route is not None, "the page never opened its websocket"
        self.route.send(json.dumps(frame))

    def start(self) -> str:
        rid = str(self.requests[-1]["id"])
        self.send({"type": "start", "id": rid, "prompt_tokens": 12, "reused_tokens": 0})
        return rid

    def chunk(self, tokens: list[dict[str, Any]]) -> None:
        rid = str(self.requests[-1]["id"])
        self.send({"type": "chunk", "id": rid, "text": "".join(t["text"] for t in tokens), "tokens": tokens})

    def done(self, n: int) -> None:
        rid = str(self.requests[-1]["id"])
        stats = {"prompt_tokens": 12, "reused_tokens": 0, "new_tokens": n, "prefill_ms": 1.0, "ttft_ms": 2.0,
                 "decode_tps": 50.0, "drafted": 0, "accepted": 0}
        self.send({"type": "done", "id": rid, "reason": "stop_token", "trigger": "<|im_end|>", "stats": stats})
