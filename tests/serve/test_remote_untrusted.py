"""Issue 42, rows 8-12: the upstream engine is untrusted input. A fake upstream (Starlette in a thread) sends an
endless line, an endless error body, a trickle that never completes an event, NaN, 1e308 and positive logprobs,
10,000 alternatives a token, and 100,000 models; a real `webchat serve --engine-url` child (its RSS watched) gives
every client a named error within the engine timeout and never grows by more than 100 MB. A fresh front per test."""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from live_child import Child, serve
from live_server import uvicorn_thread
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from websockets.sync.client import connect

from webchat.serve.remote import client as client_module
from webchat.serve.remote.client import Upstream, UpstreamError
from webchat.serve.remote.parse import ChunkError, StreamParser

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
TIMEOUT = 3.0  # --engine-timeout of the front
MODELS = 100_000


def entry(logprob: Any = -0.5, alternatives: int = 1) -> dict[str, Any]:
    top = [{"token": f"t{i}", "logprob": -0.5 - i / 100, "bytes": list(f"t{i}".encode())} for i in range(alternatives)]
    return {"token": "Hello", "logprob": logprob, "bytes": list(b"Hello"), "top_logprobs": top}


def sse(obj: Any) -> bytes:
    return f"data: {json.dumps(obj)}\n\n".encode()  # json.dumps writes NaN and Infinity as JSON never does


def chunk(e: dict[str, Any] | None = None, finish: str | None = None) -> dict[str, Any]:
    choice: dict[str, Any] = {"index": 0, "delta": {"content": "Hello"}, "finish_reason": finish}
    if e is not None:
        choice["logprobs"] = {"content": [e]}
    return {"choices": [choice]}


async def forever(first: bytes, piece: bytes, pause: float = 0.0) -> AsyncIterator[bytes]:
    yield first
    while True:
        yield piece
        await asyncio.sleep(pause)


def replies(mode: str) -> Response:
    events = {"nan": entry(float("nan")), "huge": entry(1e308), "positive": entry(0.5),
              "alternatives": entry(-0.1, alternatives=10_000)}
    if mode in events:
        body = sse(chunk(events[mode])) + sse(chunk(entry(), finish="length")) + b"data: [DONE]\n\n"
        return Response(body, media_type="text/event-stream")
    if mode == "endless-line":  # row 8: one line that never ends
        return StreamingResponse(forever(b'data: {"choices": [{"delta": {"content": "', b"x" * 65536),
                                 media_type="text/event-stream")
    if mode == "endless-error":  # row 9
        return StreamingResponse(forever(b"oops ", b"y" * 65536), status_code=500, media_type="text/plain")
    if mode == "trickle":  # bytes keep coming, an event never completes
        return StreamingResponse(forever(b'data: {"choices": ', b" ", pause=0.2), media_type="text/event-stream")
    raise AssertionError(mode)


def upstream_app() -> Starlette:
    listing = {"object": "list", "data": [{"id": f"model-{i:06d}", "object": "model"} for i in range(MODELS)]}

    async def models(request: Request) -> JSONResponse:  # row 12
        return JSONResponse(listing)

    async def chat(request: Request) -> Response:
        body = await request.json()
        if not body.get("stream"):  # the probes
            return JSONResponse({"choices": [{"index": 0, "message": {"role": "assistant", "content": "Hello"},
                                              "logprobs": {"content": [entry(alternatives=20)]},
                                              "finish_reason": "length"}]})
        return replies(body["messages"][-1]["content"])

    return Starlette(routes=[Route("/v1/models", models), Route("/v1/chat/completions", chat, methods=["POST"])])


@pytest.fixture(scope="module")
def upstream() -> Iterator[str]:
    with uvicorn_thread(upstream_app()) as url:
        yield url


@pytest.fixture
def front(upstream: str, tmp_path: Path) -> Iterator[Child]:
    """A fresh `webchat serve --engine-url` child per test (one the upstream killed cannot fail the next test)."""
    with serve(tmp_path, "--engine-url", upstream, "--engine-timeout", str(TIMEOUT), kill_mb=2000) as child:
        yield child


def converse(base: str, mode: str) -> tuple[dict[str, Any], list[dict[str, Any]], float]:
    with connect(base.replace("http://", "ws://") + "/ws", open_timeout=10, max_size=None) as ws:
        hello = json.loads(ws.recv(30))
        t0 = time.monotonic()
        ws.send(json.dumps({"type": "generate", "id": "r", "messages": [{"role": "user", "content": mode}],
                            "max_new_tokens": 8, "alternatives": 5, "settings": {"temperature": 0.0}}))
        msgs = []
        while True:
            msgs.append(json.loads(ws.recv(60)))
            if msgs[-1]["type"] in ("done", "error"):
                return hello, msgs, time.monotonic() - t0


ERRORS = {
    "endless-line": "a line is longer than 1048576 bytes",  # row 8
    "trickle": f"sent no complete event for {TIMEOUT:g} s",  # row 8: bytes arrive, an event never completes
    "endless-error": "answered HTTP 500: oops yyyy",  # row 9
    "nan": "choices[0].logprobs.content[0].logprob is NaN; expected a number",  # row 10
    "huge": "choices[0].logprobs.content[0].logprob is 1e+308; a log-probability is at most 0",  # row 10
    "positive": "choices[0].logprobs.content[0].logprob is 0.5; a log-probability is at most 0",  # row 10
}


@pytest.mark.parametrize("mode", list(ERRORS))
def test_a_hostile_reply_is_a_named_error_within_the_timeout_and_the_front_stays_small(front: Child, upstream: str,
                                                                                      mode: str) -> None:
    converse(front.url, "alternatives")  # warm: the first reply's own allocations are not the upstream's doing
    before, front.peak_mb = front.rss_mb(), 0.0
    _, msgs, took = converse(front.url, mode)
    end, peak = msgs[-1], max(front.peak_mb, front.rss_mb())  # the watcher samples every 50 ms
    print(f"{mode}: {took:.2f} s, RSS {before:.0f} MB, peak {peak:.0f} MB")
    assert end["type"] == "error" and end["code"] == "upstream" and ERRORS[mode] in end["message"], end
    assert upstream.removeprefix("http://") in end["message"]
    assert took < TIMEOUT + 2, took
    assert peak - before < 100
    assert httpx.get(f"{front.url}/healthz").status_code == 200 and "Traceback" not in front.text()


@pytest.mark.parametrize("mode", ["nan", "huge"])
def test_a_number_out_of_range_is_a_502_naming_the_field_on_the_api(front: Child, mode: str) -> None:
    """Row 10 on /v1: was HTTP 500 `internal` "OverflowError: math range error"."""
    resp = httpx.post(f"{front.url}/v1/chat/completions", timeout=30, json={
        "model": "model-000000", "messages": [{"role": "user", "content": mode}], "logprobs": True,
        "top_logprobs": 2})
    assert resp.status_code == 502 and resp.json()["error"]["code"] == "upstream", resp.text
    assert ERRORS[mode] in resp.json()["error"]["message"]


def test_ten_thousand_alternatives_are_cut_to_the_five_asked_for(front: Child) -> None:
    """Row 11: all 10,000 reached the page and the API."""
    _, msgs, _ = converse(front.url, "alternatives")
    tokens = [t for m in msgs if m["type"] == "chunk" for t in m.get("tokens") or []]
    assert msgs[-1]["type"] == "done" and [a["text"] for a in tokens[0]["top"]] == ["t0", "t1", "t2", "t3", "t4"]
    resp = httpx.post(f"{front.url}/v1/chat/completions", timeout=30, json={
        "model": "model-000000", "messages": [{"role": "user", "content": "alternatives"}], "logprobs": True,
        "top_logprobs": 3}).json()
    first = resp["choices"][0]["logprobs"]["content"][0]
    assert [a["token"] for a in first["top_logprobs"]] == ["t0", "t1", "t2"]


def test_a_list_of_100000_models_is_cut_to_256_with_a_log_line(front: Child) -> None:
    """Row 12: every hello and /api/info was 20.9 MB."""
    hello, _, _ = converse(front.url, "alternatives")
    info = httpx.get(f"{front.url}/api/info")
    assert len(info.content) < 100_000 and len(json.dumps(hello)) < 100_000
    assert hello["engine"]["models"] == [f"model-{i:06d}" for i in range(256)] and hello["engine"]["state"] == "ready"
    assert f"lists {MODELS} models; the first 256 are kept" in front.text()


# ---------------------------------------------------------------- the pieces, without a front
@pytest.mark.parametrize(("parts", "lines"), [
    ([b"data: a\n\ndata: b\n"], ["data: a", "", "data: b"]),
    ([b"data: a\r", b"\ndata: b\r\n"], ["data: a", "data: b"]),  # a CRLF split across reads is one line end
    ([b"data: a\rdata: b\r", b"x"], ["data: a", "data: b"]),  # CR alone ends a line (SSE allows it)
    ([b"da", b"ta: a", b"bc\n"], ["data: abc"]),
])
def test_sse_lines_split_as_they_arrive(parts: list[bytes], lines: list[str]) -> None:
    from webchat.serve.remote.parse import Lines

    splitter = Lines(100)
    assert [line for part in parts for line in splitter.feed(part)] == lines


def test_a_line_past_its_limit_is_refused_before_it_ends() -> None:
    from webchat.serve.remote.parse import Lines

    splitter = Lines(1000)
    splitter.feed(b"data: " + b"x" * 900)
    with pytest.raises(ChunkError, match="a line is longer than 1000 bytes"):
        splitter.feed(b"x" * 200)


@pytest.mark.parametrize(("field", "value", "words"), [
    ("logprob", float("nan"), "logprob is NaN"), ("logprob", float("inf"), "logprob is inf; a log-probability"),
    ("logprob", 1e308, "logprob is 1e+308"), ("logprob", "-1", "logprob is str '-1'; expected a number"),
    ("prob", 1.5, "prob is 1.5; a probability is between 0 and 1"), ("prob", float("nan"), "prob is NaN"),
])
def test_numbers_out_of_range_name_their_field(field: str, value: Any, words: str) -> None:
    alternatives = [{"token": "a", "logprob": -1.0}, {"token": "b", field: value}]
    bad = {"token": "a", "logprob": -1.0, "top_logprobs": alternatives}
    where = r"^choices\[0\]\.logprobs\.content\[0\]\.top_logprobs\[1\]\."
    with pytest.raises(ChunkError, match=where + re.escape(words)):
        StreamParser(5).feed(chunk(bad))


def test_rounding_above_zero_and_minus_infinity_are_probabilities() -> None:
    fine = {"token": "a", "logprob": 1e-6, "top_logprobs": [{"token": "a", "logprob": 1e-6},
                                                           {"token": "b", "logprob": float("-inf")}]}
    token = StreamParser(5).feed(chunk(fine)).tokens[0]
    assert token.prob == 1.0 and [p for _, _, p in token.top] == [1.0, 0.0]


def test_alternatives_are_cut_to_what_was_asked_best_first() -> None:
    many = {"token": "t9", "logprob": -0.1,
            "top_logprobs": [{"token": f"t{i}", "logprob": -i / 10} for i in range(10_000)][::-1][-50:]}
    token = StreamParser(3).feed(chunk(many)).tokens[0]
    assert [text for _, text, _ in token.top] == ["t0", "t1", "t2"]
    assert StreamParser(0).feed(chunk(many)).tokens[0].top == []


def test_a_reply_past_its_total_size_is_refused(upstream: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Valid events that never end: the total size bounds them (256 MiB; 1 MiB here)."""
    monkeypatch.setattr(client_module, "MAX_STREAM_BYTES", 1 << 20)

    async def run() -> str:
        up = Upstream(upstream, timeout=TIMEOUT)
        try:
            async for _ in up.stream({"messages": [{"role": "user", "content": "endless-line"}], "stream": True}):
                pass
        except (UpstreamError, ChunkError) as exc:
            return str(exc)
        finally:
            await up.aclose()
        return "no error"

    assert "sent more than 1048576 bytes in one reply" in asyncio.run(run())
