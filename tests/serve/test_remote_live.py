"""webchat on a remote engine: the upstream is a second webchat on the tiny model (uvicorn in a thread), the front
webchat runs with --engine-url pointing at it. Stream, heatmap fields, Stop, Continue, queueing and the upstream's
failures (down, never answering, answering 4xx), through the websocket and /v1."""

from __future__ import annotations

import json
import math
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
from live_server import Live, free_port, serve, uvicorn_thread  # tests/ is on sys.path under pytest
from websockets.sync.client import ClientConnection
from websockets.sync.client import connect as sync_connect

from webchat.serve.app import create_app
from webchat.serve.config import ServerConfig
from webchat.serve.runtime import Runtime, load_runtime

pytestmark = pytest.mark.timeout(180)
PROMPT = "Tell me about the quick brown fox."


@pytest.fixture(scope="module")
def config(tiny_model_dir: Path) -> ServerConfig:
    return ServerConfig(model_dir=tiny_model_dir, device="cpu", max_sessions=8, max_queue=8, max_seq_len=256)


@pytest.fixture(scope="module")
def runtime(config: ServerConfig) -> Runtime:
    return load_runtime(config)


@pytest.fixture(scope="module")
def upstream(config: ServerConfig, runtime: Runtime) -> Iterator[Live]:
    with serve(config, runtime, delay=0.01) as live:  # 10 ms a step: a Stop lands mid-reply
        yield live


@contextmanager
def front(upstream_url: str, **overrides: Any) -> Iterator[str]:
    """A webchat with generation on `upstream_url` (its lifespan probes the upstream); yields its base URL."""
    port = free_port()
    cfg = ServerConfig(model_dir=Path("."), port=port, engine_url=upstream_url, **overrides)
    with uvicorn_thread(create_app(cfg), port) as url:
        yield url


@pytest.fixture(scope="module")
def remote(upstream: Live) -> Iterator[str]:
    with front(upstream.url, max_sessions=2, max_queue=1) as url:
        yield url


def ws_url(base: str) -> str:
    return base.replace("http://", "ws://") + "/ws"


def gen(rid: str, messages: list[dict[str, str]], max_new_tokens: int = 16, **extra: Any) -> str:
    return json.dumps({"type": "generate", "id": rid, "messages": messages, "settings": {"temperature": 0.0},
                       "max_new_tokens": max_new_tokens, **extra})


def until_done(ws: ClientConnection) -> list[dict[str, Any]]:
    msgs = []
    while True:
        msg = json.loads(ws.recv(30))
        msgs.append(msg)
        if msg["type"] in ("done", "error"):
            return msgs


def converse(base: str, messages: list[dict[str, str]], **extra: Any) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    with sync_connect(ws_url(base)) as ws:
        hello = json.loads(ws.recv(10))
        assert hello["type"] == "hello"
        ws.send(gen("r", messages, **extra))
        return hello, until_done(ws)


def tokens_of(msgs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [t for m in msgs if m["type"] == "chunk" for t in m.get("tokens") or []]


def text_of(msgs: list[dict[str, Any]]) -> str:
    return "".join(m["text"] for m in msgs if m["type"] == "chunk")


def test_capabilities_are_probed_and_shown(remote: str, upstream: Live, tiny_model_dir: Path) -> None:
    info = httpx.get(f"{remote}/api/info").json()
    engine = info["engine"]
    assert engine["state"] == "ready" and engine["kind"] == "webchat" and engine["url"] == upstream.url
    assert engine["models"] == [tiny_model_dir.name] and engine["model"] == tiny_model_dir.name
    assert engine["max_top_logprobs"] == 20 and engine["bytes"] == "returned" and engine["probabilities"] == "raw"
    assert engine["token_ids"] == "per_entry"  # webchat's /v1 entries carry `id`, as llama.cpp's do
    assert engine["token_prompt"] == "tokenize"  # a branch's ids go after /tokenize's prompt ids
    assert engine["continue_final"] == "continue_final_message"
    assert engine["response_format"] == "json_schema" and engine["tools"] == "accepted"  # structured output passes
    assert engine["context_length"] == 256 and info["context_length"] == 256
    hello, _ = converse(remote, [{"role": "user", "content": "Hi"}], max_new_tokens=1)
    assert hello["engine"] == engine and hello["device"] == "remote"


def test_websocket_stream_matches_the_upstreams_own(remote: str, upstream: Live) -> None:
    """Same greedy text, same per-token p (1e-4), ranks and alternatives as the upstream's own websocket."""
    messages = [{"role": "user", "content": PROMPT}]
    _, local = converse(upstream.url, messages, alternatives=5)
    _, far = converse(remote, messages, alternatives=5)
    assert far[-1]["type"] == "done" and far[-1]["reason"] == local[-1]["reason"]
    assert text_of(far) == text_of(local) and text_of(far)
    near_t, far_t = tokens_of(local), tokens_of(far)
    assert len(far_t) == len(near_t) > 0
    for a, b in zip(near_t, far_t, strict=True):
        assert b["text"] == a["text"] and b["p"] == pytest.approx(a["p"], abs=1e-4)
        assert b["rank"] == (a["rank"] if a["rank"] <= 5 else None)
        assert [x["p"] for x in b["top"]] == pytest.approx([x["p"] for x in a["top"]], abs=1e-4)
        assert b["id"] == a["id"] and [x["id"] for x in b["top"]] == [x["id"] for x in a["top"]]
    assert far[-1]["stats"]["new_tokens"] == local[-1]["stats"]["new_tokens"]
    assert far[-1]["stats"]["prompt_tokens"] == local[-1]["stats"]["prompt_tokens"]  # from the upstream's usage


def test_v1_through_the_remote_matches_the_upstream(remote: str, upstream: Live, tiny_model_dir: Path) -> None:
    body = {"model": tiny_model_dir.name, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 12,
            "temperature": 0, "logprobs": True, "top_logprobs": 3}
    direct = httpx.post(f"{upstream.url}/v1/chat/completions", json=body, timeout=60).json()
    far = httpx.post(f"{remote}/v1/chat/completions", json=body, timeout=60).json()
    assert far["choices"][0]["message"]["content"] == direct["choices"][0]["message"]["content"]
    a, b = direct["choices"][0]["logprobs"]["content"], far["choices"][0]["logprobs"]["content"]
    assert [e["token"] for e in b] == [e["token"] for e in a]
    assert [e["logprob"] for e in b] == pytest.approx([e["logprob"] for e in a], abs=1e-4)
    streamed = ""
    with httpx.stream("POST", f"{remote}/v1/chat/completions", json={**body, "stream": True}, timeout=60) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                for choice in json.loads(line[6:])["choices"]:
                    streamed += choice["delta"].get("content") or ""
    assert streamed == direct["choices"][0]["message"]["content"]


def test_continue_sends_the_prefix_upstream(remote: str, upstream: Live) -> None:
    messages = [{"role": "user", "content": PROMPT}, {"role": "assistant", "content": "The quick"}]
    _, local = converse(upstream.url, messages, **{"continue": True})
    _, far = converse(remote, messages, **{"continue": True})
    assert far[-1]["type"] == "done" and text_of(far) == text_of(local) and text_of(far)
    _, fresh = converse(remote, messages[:1])
    assert text_of(fresh) != text_of(far)  # the prefix changed what came next


def spelled_out(runtime: Runtime, text: str) -> list[int]:
    """`text` as one token per character: ids the tokenizer would never choose for it (it merges them)."""
    ids = [i for c in text for i in runtime.local()[1].encode_text(c)]
    assert len(ids) == len(text) and ids != runtime.local()[1].encode_text(text)
    return ids


def test_a_branch_given_as_token_ids_runs_on_those_ids(upstream: Live, remote: str, runtime: Runtime,
                                                       tiny_model_dir: Path) -> None:  # fmt: skip
    """prefix_ids: the prompt is the chat's generation prompt and then exactly these ids, locally (the same as a
    /v1/completions on those ids) and through a remote webchat (sent as /tokenize's ids and these ids)."""
    head = [{"role": "user", "content": PROMPT}]
    messages = [*head, {"role": "assistant", "content": "The quick"}]
    ids = spelled_out(runtime, "The quick")
    prompt = runtime.encode_chat(head) + ids
    _, local = converse(upstream.url, messages, alternatives=5, prefix_ids=ids, **{"continue": True})
    assert local[-1]["type"] == "done" and local[-1]["stats"]["prompt_tokens"] == len(prompt)
    _, by_text = converse(upstream.url, messages, **{"continue": True})  # re-tokenised: the merged ids
    assert by_text[-1]["stats"]["prompt_tokens"] == len(runtime.encode_chat(messages, continue_final=True))
    assert by_text[-1]["stats"]["prompt_tokens"] != len(prompt)
    body = {"model": tiny_model_dir.name, "prompt": prompt, "max_tokens": 16, "temperature": 0, "logprobs": 5}
    direct = httpx.post(f"{upstream.url}/v1/completions", json=body, timeout=60).json()["choices"][0]
    assert text_of(local) == direct["text"] and text_of(local)
    assert [t["p"] for t in tokens_of(local)] == pytest.approx(
        [math.exp(v) for v in direct["logprobs"]["token_logprobs"]], abs=1e-4)
    _, far = converse(remote, messages, alternatives=5, prefix_ids=ids, **{"continue": True})
    assert far[-1]["type"] == "done" and text_of(far) == text_of(local)
    assert far[-1]["stats"]["prompt_tokens"] == len(prompt)  # the upstream's usage: the ids went as they are
    near_t, far_t = tokens_of(local), tokens_of(far)
    assert [t["id"] for t in far_t] == [t["id"] for t in near_t]
    assert [t["p"] for t in far_t] == pytest.approx([t["p"] for t in near_t], abs=1e-4)
    for a, b in zip(near_t, far_t, strict=True):  # legacy alternatives: text and p; an id only on the sampled one
        assert [x["text"] for x in b["top"]] == [x["text"] for x in a["top"]]
        assert [x["p"] for x in b["top"]] == pytest.approx([x["p"] for x in a["top"]], abs=1e-4)


def test_tokenize_answers_the_prompt_ids_the_chat_endpoint_runs_on(upstream: Live, runtime: Runtime) -> None:
    """vLLM's /tokenize shape: chat messages as /v1/chat/completions templates them, or a text."""
    chat = [{"role": "user", "content": PROMPT}]
    got = httpx.post(f"{upstream.url}/tokenize", json={"messages": chat}, timeout=30).json()
    assert got["tokens"] == runtime.encode_chat(chat) and got["count"] == len(got["tokens"])
    assert got["max_model_len"] == 256
    cont = [*chat, {"role": "assistant", "content": "The"}]
    got = httpx.post(f"{upstream.url}/tokenize", json={"messages": cont, "add_generation_prompt": False,
                                                       "continue_final_message": True}, timeout=30).json()
    assert got["tokens"] == runtime.encode_chat(cont, continue_final=True)
    got = httpx.post(f"{upstream.url}/tokenize", json={"prompt": "The quick"}, timeout=30).json()
    assert got["tokens"] == runtime.local()[1].encode_text("The quick")
    both = httpx.post(f"{upstream.url}/tokenize", json={"prompt": "x", "messages": chat}, timeout=30)
    assert both.status_code == 400 and "not both" in both.json()["error"]["message"]
    wrong = httpx.post(f"{upstream.url}/tokenize", json={"prompt": "x", "model": "nope"}, timeout=30)
    assert wrong.status_code == 404 and wrong.json()["error"]["code"] == "model_not_found"


@pytest.mark.parametrize(("extra", "words"), [
    ({"prefix_ids": [54]}, "need continue: true"),
    ({"prefix_ids": [54, 100_000], "continue": True}, "prefix_ids must be a token id in [0, 511], got 100000"),
    ({"prefix_ids": [54, -1], "continue": True}, "prefix_ids[1] = -1 is not a token id"),
    ({"prefix_ids": [], "continue": True}, "prefix_ids"),
    ({"prefix_ids": [327, 223], "continue": True},
     'spell "The ", the final message is "The" (they differ from character 3)'),
])
def test_bad_prefix_ids_are_named(upstream: Live, extra: dict[str, Any], words: str) -> None:
    messages = [{"role": "user", "content": PROMPT}, {"role": "assistant", "content": "The"}]
    if "continue" not in extra:
        messages = messages[:1]
    _, msgs = converse(upstream.url, messages, **extra)
    assert msgs[-1]["type"] == "error" and msgs[-1]["code"] == "bad_message", msgs[-1]
    assert words in msgs[-1]["message"] and "prefix_ids" in msgs[-1]["message"]


def upstream_active(upstream: Live) -> int:
    active: int = httpx.get(f"{upstream.url}/api/info").json()["active"]
    return active


def test_stop_closes_the_upstream_stream(remote: str, upstream: Live) -> None:
    """Stop ends the reply and the upstream's running count drops to 0 well before its 200 tokens were made."""
    with sync_connect(ws_url(remote)) as ws:
        json.loads(ws.recv(10))
        ws.send(gen("long", [{"role": "user", "content": PROMPT}], max_new_tokens=200, stop=["\u2603"]))
        while json.loads(ws.recv(30))["type"] != "chunk":
            pass
        assert upstream_active(upstream) == 1
        ws.send(json.dumps({"type": "stop", "id": "long"}))
        msgs = until_done(ws)
        assert msgs[-1]["type"] == "done" and msgs[-1]["reason"] == "cancelled"
        deadline = time.monotonic() + 10
        while upstream_active(upstream) and time.monotonic() < deadline:
            time.sleep(0.005)
        assert upstream_active(upstream) == 0
        assert upstream.probe.after_cancel  # the upstream's sequence was cancelled: its stream's close reached it
        assert msgs[-1]["stats"]["new_tokens"] < 200


def test_disconnect_closes_the_upstream_stream(remote: str, upstream: Live) -> None:
    with sync_connect(ws_url(remote)) as ws:
        json.loads(ws.recv(10))
        ws.send(gen("gone", [{"role": "user", "content": PROMPT}], max_new_tokens=200))
        while json.loads(ws.recv(30))["type"] != "chunk":
            pass
    deadline = time.monotonic() + 10
    while upstream_active(upstream) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert upstream_active(upstream) == 0 and upstream.probe.after_cancel


def test_queueing_is_fifo_and_bounded(remote: str) -> None:
    """max_sessions 2 streams upstream at once, max_queue 1 waits; the fourth is told busy."""
    with ExitStack() as stack:
        conns = [stack.enter_context(sync_connect(ws_url(remote))) for _ in range(4)]
        for i, ws in enumerate(conns):
            json.loads(ws.recv(10))
            ws.send(gen(f"q{i}", [{"role": "user", "content": PROMPT}], max_new_tokens=60))
        assert json.loads(conns[2].recv(10)) == {"type": "queued", "id": "q2", "position": 1}
        assert json.loads(conns[3].recv(10))["code"] == "busy"
        for ws in conns[:3]:
            assert until_done(ws)[-1]["type"] == "done"


def test_upstream_error_reply_is_named(remote: str, upstream: Live, tiny_model_dir: Path) -> None:
    """The upstream refuses: a context overflow is `prompt_too_long`, another 4xx `upstream`; both name it."""
    _, msgs = converse(remote, [{"role": "user", "content": PROMPT}], max_new_tokens=5000)
    assert msgs[-1]["type"] == "error" and msgs[-1]["code"] == "prompt_too_long"
    assert upstream.url in msgs[-1]["message"] and "400" in msgs[-1]["message"]
    resp = httpx.post(f"{remote}/v1/chat/completions", timeout=30, json={
        "model": tiny_model_dir.name, "messages": [{"role": "user", "content": PROMPT}], "logit_bias": {"9999999": 1}})
    assert resp.status_code == 502 and resp.json()["error"]["code"] == "upstream"
    assert upstream.url in resp.json()["error"]["message"] and "logit_bias" in resp.json()["error"]["message"]
    _, again = converse(remote, [{"role": "user", "content": "Hi"}], max_new_tokens=2)
    assert again[-1]["type"] == "done"  # the server keeps serving


def test_upstream_down_is_a_named_state_and_error(config: ServerConfig, runtime: Runtime,
                                                  tiny_model_dir: Path) -> None:  # fmt: skip
    """Down at start: a named state and error; once it is up, the next request probes it again and is served."""
    port = free_port()
    dead = f"http://127.0.0.1:{port}"
    with front(dead, engine_key="sekret-key") as base:
        info = httpx.get(f"{base}/api/info").json()
        assert info["engine"]["state"] == "unreachable" and dead in info["engine"]["error"]
        hello, msgs = converse(base, [{"role": "user", "content": "Hi"}])
        assert hello["engine"]["state"] == "unreachable"
        assert msgs[-1]["type"] == "error" and msgs[-1]["code"] == "upstream" and dead in msgs[-1]["message"]
        resp = httpx.post(f"{base}/v1/chat/completions", json={"model": "x", "messages": [
            {"role": "user", "content": "Hi"}]}, timeout=30)
        assert resp.status_code in (404, 502)
        page = httpx.get(f"{base}/").text + json.dumps(info) + json.dumps(hello)
        assert "sekret-key" not in page  # the upstream key never reaches the page
        with serve(config, runtime, port=port):
            _, msgs = converse(base, [{"role": "user", "content": "Hi"}], max_new_tokens=3)
            assert msgs[-1]["type"] == "done"
            info = httpx.get(f"{base}/api/info").json()
            assert info["engine"]["state"] == "ready" and info["model"] == tiny_model_dir.name
            resp = httpx.post(f"{base}/v1/chat/completions", timeout=30, json={
                "model": tiny_model_dir.name, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2})
            assert resp.status_code == 200


def test_upstream_that_never_answers_times_out_named(upstream: Live) -> None:
    """A socket that accepts and says nothing: the probe and the request fail after engine_timeout, named."""
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(16)
    url = f"http://127.0.0.1:{silent.getsockname()[1]}"
    try:
        with front(url, engine_timeout=0.5) as base:
            assert httpx.get(f"{base}/api/info").json()["engine"]["state"] == "unreachable"
            _, msgs = converse(base, [{"role": "user", "content": "Hi"}])
            assert msgs[-1]["code"] == "upstream" and "sent nothing for 0.5 s" in msgs[-1]["message"]
    finally:
        silent.close()


class Relay:
    """A TCP relay to `target_port` whose cut() drops every connection at once: an upstream killed mid-stream."""

    def __init__(self, target_port: int) -> None:
        self.target, self.socks, self.lock = target_port, [], threading.Lock()
        self.sent = bytearray()  # everything the front sent upstream
        self.server = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.server.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.server.accept()
            except OSError:
                return
            far = socket.create_connection(("127.0.0.1", self.target))
            with self.lock:
                self.socks += [client, far]
            for a, b, log in ((client, far, self.sent), (far, client, None)):
                threading.Thread(target=self._pump, args=(a, b, log), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, log: bytearray | None) -> None:
        try:
            while data := src.recv(65536):
                if log is not None:
                    with self.lock:
                        log += data
                dst.sendall(data)
        except OSError:
            pass

    def cut(self) -> None:
        with self.lock:
            for sock in self.socks:
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                sock.close()
            self.socks.clear()

    def close(self) -> None:
        self.server.close()
        self.cut()


def test_upstream_killed_mid_stream_keeps_the_text(upstream: Live) -> None:
    """The upstream goes away mid-reply: the chunks already sent stay on the page, then an `upstream` error; the
    next request finds the upstream again (probed anew)."""
    relay = Relay(int(upstream.url.rsplit(":", 1)[1]))
    try:
        with front(relay.url) as base, sync_connect(ws_url(base)) as ws:
            json.loads(ws.recv(10))
            ws.send(gen("k", [{"role": "user", "content": PROMPT}], max_new_tokens=200, stop=["\u2603"]))
            while (first := json.loads(ws.recv(30)))["type"] != "chunk":
                pass
            relay.cut()
            msgs = until_done(ws)
            assert first["text"] or first.get("tokens") is None
            assert msgs[-1]["type"] == "error" and msgs[-1]["code"] == "upstream"
            assert relay.url in msgs[-1]["message"] and "closed the connection mid-reply" in msgs[-1]["message"]
            ws.send(gen("k2", [{"role": "user", "content": "Hi"}], max_new_tokens=3))
            assert until_done(ws)[-1]["type"] == "done"  # the relay still accepts: reconnected
    finally:
        relay.close()


def test_a_conversation_keeps_its_key_and_its_prefix_across_turns(upstream: Live) -> None:
    """The `user` field and the affinity header carry one key for every turn; turn 2's messages start with turn 1's
    byte for byte (what a prefix-cache-aware router and the upstream's prefix cache need)."""
    relay = Relay(int(upstream.url.rsplit(":", 1)[1]))
    try:
        with front(relay.url, engine_affinity_header="X-Session-Id") as base:
            relay.sent.clear()  # the probes
            turn1 = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
            _, msgs = converse(base, turn1, max_new_tokens=4)
            turn2 = [*turn1, {"role": "assistant", "content": text_of(msgs)}, {"role": "user", "content": "More"}]
            converse(base, turn2, max_new_tokens=4)
            _, other = converse(base, [{"role": "user", "content": "Another chat"}], max_new_tokens=2)
        requests = [r for r in bytes(relay.sent).split(b"POST /v1/chat/completions")[1:]]
        assert len(requests) == 3
        heads = [r.split(b"\r\n\r\n", 1)[0].decode() for r in requests]
        bodies = [json.loads(r.split(b"\r\n\r\n", 1)[1]) for r in requests]
        keys = [next(line.split(":", 1)[1].strip() for line in h.split("\r\n") if line.lower().startswith(
            "x-session-id:")) for h in heads]
        assert keys[0] == keys[1] == bodies[0]["user"] == bodies[1]["user"] != keys[2]
        raw = [r.split(b"\r\n\r\n", 1)[1] for r in requests[:2]]
        start = raw[0].index(b'"messages":')
        first_msgs = raw[0][start:raw[0].index(b"]", start)]  # turn 1's messages as sent, without the closing "]"
        assert len(first_msgs) > 40 and first_msgs in raw[1]
    finally:
        relay.close()


def fake_upstream_app() -> Any:
    """An OpenAI-shaped upstream that streams one good token, then what the last user message asks for: a chunk that
    is not JSON, or the stream's own error event."""
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, StreamingResponse
    from starlette.routing import Route

    entry = {"token": "Hello", "logprob": -0.5, "bytes": list(b"Hello"),
             "top_logprobs": [{"token": "Hello", "logprob": -0.5, "bytes": list(b"Hello")}]}

    async def models(request: Request) -> JSONResponse:
        return JSONResponse({"object": "list", "data": [{"id": "fake", "object": "model"}]})

    async def chat(request: Request) -> Any:
        body = await request.json()
        if not body.get("stream"):
            return JSONResponse({"choices": [{"index": 0, "message": {"role": "assistant", "content": "Hello"},
                                              "logprobs": {"content": [entry]}, "finish_reason": "length"}]})
        mode = body["messages"][-1]["content"]

        async def events() -> Any:
            first = {"choices": [{"index": 0, "delta": {"content": "Hello"}, "logprobs": {"content": [entry]}}]}
            yield f"data: {json.dumps(first)}\n\n"
            yield "data: {not json\n\n" if mode == "malformed" else \
                'data: {"error": {"message": "the engine ran out of memory"}}\n\n'

        return StreamingResponse(events(), media_type="text/event-stream")

    return Starlette(routes=[Route("/v1/models", models), Route("/v1/chat/completions", chat, methods=["POST"])])


@pytest.mark.parametrize(("mode", "words"), [("malformed", "sent a malformed chunk: a chunk is not JSON"),
                                             ("error", "reported an error mid-reply: the engine ran out of memory")])
def test_a_bad_chunk_mid_reply_keeps_the_text_and_names_the_upstream(mode: str, words: str) -> None:
    with uvicorn_thread(fake_upstream_app()) as upstream, front(upstream) as base:
        _, msgs = converse(base, [{"role": "user", "content": mode}], alternatives=1)
        assert text_of(msgs) == "Hello" and tokens_of(msgs)[0]["p"] == pytest.approx(0.6065, abs=1e-4)
        assert msgs[-1]["type"] == "error" and msgs[-1]["code"] == "upstream"
        assert upstream.removeprefix("http://") in msgs[-1]["message"] and words in msgs[-1]["message"]


CHOICE = {"type": "object", "properties": {"c": {"enum": ["up", "down"]}, "n": {"type": "integer", "minimum": 0,
                                                                                  "maximum": 9}},
          "required": ["c", "n"], "additionalProperties": False}
TOOL = {"type": "function", "function": {"name": "move", "parameters": CHOICE}}


@pytest.fixture(scope="module")
def roomy(tiny_model_dir: Path) -> Iterator[tuple[Live, str]]:
    """An upstream with room for a tools prompt (the generic one is ~540 tiny-model tokens), and a front on it."""
    config = ServerConfig(model_dir=tiny_model_dir, device="cpu", max_sessions=2, max_queue=4, max_seq_len=1024)
    with serve(config, load_runtime(config)) as live, front(live.url) as url:
        yield live, url


def test_a_reply_format_and_tools_pass_through_to_the_upstream(roomy: tuple[Live, str], tiny_model_dir: Path) -> None:
    """The upstream enforces them: the remote's replies equal the upstream's own (greedy), tool calls included,
    whole and streamed; and the websocket's response_format reaches it too."""
    upstream, remote = roomy
    base = {"model": tiny_model_dir.name, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 300,
            "temperature": 0}
    fmt = {"response_format": {"type": "json_schema", "json_schema": {"name": "c", "schema": CHOICE}}}
    direct = httpx.post(f"{upstream.url}/v1/chat/completions", json={**base, **fmt}, timeout=60).json()
    far = httpx.post(f"{remote}/v1/chat/completions", json={**base, **fmt}, timeout=60).json()
    text = far["choices"][0]["message"]["content"]
    assert text == direct["choices"][0]["message"]["content"] and set(json.loads(text)) == {"c", "n"}
    tools = {"tools": [TOOL], "tool_choice": "required", "parallel_tool_calls": False}
    direct = httpx.post(f"{upstream.url}/v1/chat/completions", json={**base, **tools}, timeout=60).json()
    far = httpx.post(f"{remote}/v1/chat/completions", json={**base, **tools}, timeout=60).json()
    want = [(c["function"]["name"], json.loads(c["function"]["arguments"]))
            for c in direct["choices"][0]["message"]["tool_calls"]]
    got = [(c["function"]["name"], json.loads(c["function"]["arguments"]))
           for c in far["choices"][0]["message"]["tool_calls"]]
    assert got == want and len(got) == 1 and far["choices"][0]["finish_reason"] == "tool_calls"
    streamed: dict[int, list[str]] = {}
    with httpx.stream("POST", f"{remote}/v1/chat/completions", json={**base, **tools, "stream": True},
                      timeout=60) as resp:
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                for choice in json.loads(line[6:])["choices"]:
                    for d in choice["delta"].get("tool_calls") or []:
                        entry = streamed.setdefault(d["index"], [d["function"].get("name") or "", ""])
                        entry[1] += d["function"].get("arguments") or ""
    assert [(n, json.loads(a)) for n, a in streamed.values()] == want
    _, msgs = converse(remote, [{"role": "user", "content": "Go"}], max_new_tokens=60,
                       response_format={"type": "json_schema", "json_schema": {"name": "c", "schema": CHOICE}})
    assert msgs[-1]["type"] == "done" and set(json.loads(text_of(msgs))) == {"c", "n"}
