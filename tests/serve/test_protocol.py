"""The wire protocol through Starlette's TestClient: every message type and every error code of docs/protocol.md."""

from __future__ import annotations

import asyncio
import copy
import json
import re
import time
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from live_server import Probe  # tests/ is on sys.path under pytest
from starlette.testclient import TestClient, WebSocketDenialResponse

from webchat.kernels.cpu import build as qkernels
from webchat.serve import protocol as p
from webchat.serve.app import create_app
from webchat.serve.config import ServerConfig
from webchat.serve.runtime import Runtime, load_runtime

pytestmark = pytest.mark.timeout(120)

USER = [{"role": "user", "content": "Hello there, how are you?"}]
GREEDY = {"temperature": 0.0}


class Slowed(Probe):
    """The engine with every step taking at least `delay` seconds, so requests overlap in tests."""


class Exploding(Probe):
    def step(self) -> None:
        raise RuntimeError("device on fire")


@pytest.fixture(scope="module")
def config(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> ServerConfig:
    templates = tmp_path_factory.mktemp("templates")
    (templates / "index.html").write_text(
        "<title>{{ model_name }}</title><p id=ctx>{{ context_length }}</p>"
        '<script type="module" src="/static/app.js?v={{ static_version }}"></script>'
    )
    static = tmp_path_factory.mktemp("static")
    (static / "app.js").write_text("export const x = 1;\n")
    return ServerConfig(model_dir=tiny_model_dir, device="cpu", max_sessions=2, max_queue=1, max_message_bytes=4096,
                        max_seq_len=256, templates_dir=templates, static_dir=static)


@pytest.fixture(scope="module")
def runtime(config: ServerConfig) -> Runtime:
    return load_runtime(config)


def make_client(config: ServerConfig, runtime: Runtime, delay: float = 0.0, gen_type: type[Probe] = Slowed,
                **changes: Any) -> TestClient:
    rt = replace(runtime, engine=gen_type(runtime.engine, delay))
    return TestClient(create_app(replace(config, **changes), runtime=rt))


@pytest.fixture
def client(config: ServerConfig, runtime: Runtime) -> Iterator[TestClient]:
    with make_client(config, runtime) as c:
        yield c


@pytest.fixture
def stack() -> Iterator[ExitStack]:
    """Websocket sessions opened by a test; requested after the client, so closed before it."""
    with ExitStack() as s:
        yield s


@pytest.fixture
def slow_client(config: ServerConfig, runtime: Runtime) -> Iterator[TestClient]:
    with make_client(config, runtime, delay=0.05) as c:
        yield c


def generate(rid: str, **fields: Any) -> dict[str, Any]:
    msg: dict[str, Any] = {"type": "generate", "id": rid, "messages": USER, "settings": GREEDY, "max_new_tokens": 8}
    msg.update(fields)
    return msg


def run_to_end(ws: Any, rid: str) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Receive until this request's done or error; (everything received, that last message)."""
    seen: list[dict[str, Any]] = []
    while True:
        msg = ws.receive_json()
        seen.append(msg)
        if msg["type"] in ("done", "error") and msg["id"] == rid:
            return seen, msg


def connect(c: TestClient, stack: ExitStack, **kwargs: Any) -> Any:
    ws = stack.enter_context(c.websocket_connect("/ws", **kwargs))
    hello = ws.receive_json()
    assert hello["type"] == "hello", hello
    return ws


def direct_greedy(runtime: Runtime, max_new_tokens: int, alternatives: int = 0) -> str:
    from webchat.engine.sequence import GenerationRequest
    from webchat.engine.settings import SamplingSettings

    gen = runtime.new_generator()
    gen.begin_stream(GenerationRequest(prompt_ids=runtime.encode_chat(USER), settings=SamplingSettings(temperature=0.0),
                                       max_new_tokens=max_new_tokens, return_probs=alternatives > 0,
                                       top_alts=alternatives))
    text = ""
    while True:
        res = gen.stream()
        text += str(res.text)
        if res.eos:
            return text


def assert_still_works(ws: Any, rid: str = "after") -> None:
    seen, last = run_to_end_after_send(ws, generate(rid))
    assert last["type"] == "done", last


def run_to_end_after_send(ws: Any, msg: dict[str, Any]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    ws.send_json(msg)
    return run_to_end(ws, msg["id"])


# ---------------------------------------------------------------- message types
def test_hello_and_info_describe_the_model(client: TestClient, runtime: Runtime) -> None:
    with client.websocket_connect("/ws") as ws:
        hello = p.Hello.model_validate(ws.receive_json())
    assert hello.v == p.VERSION and hello.model == runtime.model_name
    assert hello.context_length == 256 and hello.device == "cpu" and hello.dtype == "float32"
    assert hello.speculative == ["auto", "none", "self", "ngram"] and hello.max_alternatives == 20
    assert hello.weights == "float32" and hello.precision == "exact"  # float weights: float32 activations
    info = client.get("/api/info").json()
    assert info["model"] == hello.model and info["speculative"] == hello.speculative
    assert info["precision"] == "exact"
    assert info["cpu_kernels"] == qkernels.running()  # the code path the C++ kernels run, where they are loaded
    if info["cpu_kernels"] is not None:
        kernels = info["cpu_kernels"]
        assert kernels["path"] in qkernels.available_paths() and isinstance(kernels["vnni"], bool)
    assert info["max_sessions"] == 2 and info["default_speculative"] == "auto"
    spec = info["speculation"]  # the auto mode's cost curve (measured at warm-up or its first step) and decisions
    assert {"cost", "between_steps_ms", "steps", "offers", "granted", "drafted", "accepted"} <= set(spec)
    health = client.get("/healthz").json()
    pool = health.pop("kv_pool")
    assert health == {"status": "ok", "active": 0, "queued": 0, "sessions": 0}
    assert pool["pages"] > 0 and pool["running"] == 0 and info["kv_pool"]["page_size"] == pool["page_size"]


def test_generate_streams_start_chunks_done_matching_the_generator(
    client: TestClient, stack: ExitStack, runtime: Runtime
) -> None:
    ws = connect(client, stack)
    seen, done = run_to_end_after_send(ws, generate("r1", max_new_tokens=12))
    kinds = [m["type"] for m in seen]
    assert kinds[0] == "start" and kinds[-1] == "done" and set(kinds[1:-1]) <= {"chunk"}, kinds
    start = p.Start.model_validate(seen[0])
    assert start.prompt_tokens == len(runtime.encode_chat(USER)) and start.reused_tokens == 0
    chunks = [p.Chunk.model_validate(m) for m in seen[1:-1]]
    assert all(c.tokens is None and "tokens" not in m for c, m in zip(chunks, seen[1:-1], strict=True))
    assert "".join(c.text for c in chunks) == direct_greedy(runtime, 12)
    done_msg = p.Done.model_validate(done)
    assert done_msg.stats.prompt_tokens == start.prompt_tokens and 1 <= done_msg.stats.new_tokens <= 12
    # the next turn of the same conversation reuses the cached prefix
    seen2, done2 = run_to_end_after_send(ws, generate("r2", max_new_tokens=4))
    assert seen2[0]["type"] == "start" and seen2[0]["reused_tokens"] > 0, seen2[0]


def test_alternatives_carry_probabilities_that_rebuild_the_text(client: TestClient, stack: ExitStack) -> None:
    ws = connect(client, stack)
    seen, done = run_to_end_after_send(ws, generate("a", max_new_tokens=10, alternatives=3))
    chunks = [p.Chunk.model_validate(m) for m in seen if m["type"] == "chunk"]
    tokens = [t for c in chunks for t in c.tokens or []]
    assert len(tokens) >= done["stats"]["new_tokens"] - 1 > 0
    for c in chunks:
        assert "".join(t.text for t in c.tokens or []) == c.text
    for t in tokens:
        assert 0.0 <= t.p <= 1.0 and t.rank >= 1 and len(t.top) == 3
        probs = [a.p for a in t.top]
        assert probs == sorted(probs, reverse=True)
        assert t.rank == 1 and t.top[0].id == t.id  # greedy picks the top token
        assert t.sampled_p == 1.0  # greedy: drawn with certainty


def test_sampled_p_is_the_probability_after_the_settings(client: TestClient, stack: ExitStack) -> None:
    """top_k 2 at temperature 1 (no other truncation): sampled_p = p / (p_1 + p_2) over the two most likely."""
    ws = connect(client, stack)
    settings = {"temperature": 1.0, "top_k": 2, "top_p": 1.0, "min_p": 0.0, "seed": 3}
    seen, done = run_to_end_after_send(ws, generate("q", max_new_tokens=10, alternatives=2, settings=settings))
    tokens = [t for m in seen if m["type"] == "chunk" for t in m["tokens"]]
    assert tokens and done["type"] == "done", done
    for t in tokens:
        assert t["rank"] <= 2, t
        want = t["p"] / (t["top"][0]["p"] + t["top"][1]["p"])
        assert t["sampled_p"] == pytest.approx(want, rel=1e-4), t


def test_stop_cancels_within_a_step_and_the_connection_stays_open(slow_client: TestClient, stack: ExitStack) -> None:
    ws = connect(slow_client, stack)
    ws.send_json(generate("s", max_new_tokens=200))
    assert ws.receive_json()["type"] == "start"
    assert ws.receive_json()["type"] == "chunk"
    ws.send_json({"type": "stop", "id": "s"})
    seen, done = run_to_end(ws, "s")
    assert done["type"] == "done" and done["reason"] == "cancelled", done
    assert len(seen) <= 3 and done["stats"]["new_tokens"] < 10, seen  # 50 ms steps: one step, not the 200
    ws.send_json({"type": "stop", "id": "nothing-running"})  # ignored
    assert_still_works(ws)


def test_queued_positions_then_start_when_a_slot_frees(config: ServerConfig, runtime: Runtime) -> None:
    with make_client(config, runtime, delay=0.02, max_sessions=1, max_queue=2) as c, ExitStack() as stack:
        first, second, third = connect(c, stack), connect(c, stack), connect(c, stack)
        first.send_json(generate("one", max_new_tokens=10))
        assert first.receive_json()["type"] == "start"
        second.send_json(generate("two", max_new_tokens=3))
        assert second.receive_json() == {"type": "queued", "id": "two", "position": 1}
        third.send_json(generate("three", max_new_tokens=3))
        assert third.receive_json() == {"type": "queued", "id": "three", "position": 2}
        assert c.get("/healthz").json()["queued"] == 2
        run_to_end(first, "one")
        seen, done = run_to_end(second, "two")
        assert seen[0]["type"] == "start" and done["type"] == "done"
        seen3, done3 = run_to_end(third, "three")
        assert [m for m in seen3 if m["type"] == "queued"] == [{"type": "queued", "id": "three", "position": 1}]
        assert done3["type"] == "done"


def test_stop_while_queued_answers_done_cancelled(config: ServerConfig, runtime: Runtime) -> None:
    with make_client(config, runtime, delay=0.02, max_sessions=1, max_queue=2) as c, ExitStack() as stack:
        first, second = connect(c, stack), connect(c, stack)
        first.send_json(generate("one", max_new_tokens=30))
        assert first.receive_json()["type"] == "start"
        second.send_json(generate("two"))
        assert second.receive_json()["type"] == "queued"
        second.send_json({"type": "stop", "id": "two"})
        done = second.receive_json()
        assert done["type"] == "done" and done["reason"] == "cancelled" and done["stats"]["new_tokens"] == 0
        first.send_json({"type": "stop", "id": "one"})
        run_to_end(first, "one")
        assert_still_works(second)


# ---------------------------------------------------------------- errors: each named, each survivable
@pytest.mark.parametrize("frame", ["{", "[1, 2]", '"text"', "NaN", '{"type": "generate", "id": Infinity}', ""])
def test_bad_json(client: TestClient, stack: ExitStack, frame: str) -> None:
    ws = connect(client, stack)
    ws.send_text(frame)
    err = p.Error.model_validate(ws.receive_json())
    assert err.code == "bad_json" and err.id is None, err
    assert_still_works(ws)


def test_binary_frame_is_bad_json(client: TestClient, stack: ExitStack) -> None:
    ws = connect(client, stack)
    ws.send_bytes(b'{"type": "stop", "id": "x"}')
    assert ws.receive_json()["code"] == "bad_json"
    assert_still_works(ws)


@pytest.mark.parametrize(
    ("msg", "field"),
    [
        ({"type": "summon", "id": "x"}, "type"),
        ({"id": "x"}, "type"),
        ({"type": "generate", "id": "x"}, "messages"),
        ({"type": "stop"}, "id"),
        (generate("x", max_new_tokens="8"), "max_new_tokens"),
        (generate("x", max_new_tokens=8.0), "max_new_tokens"),
        (generate("x", alternatives=True), "alternatives"),
        (generate("x", settings={"temperature": "hot"}), "settings.temperature"),
        (generate("x", settings={"warmth": 1}), "settings.warmth"),
        (generate("x", messages=[{"role": "bot", "content": "hi"}]), "messages.0.role"),
        (generate("x", messages=[{"role": "user"}]), "messages.0.content"),
        (generate("x", messages=[{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]), "messages"),
        (generate("x", messages=[]), "messages"),
        (generate("x", **{"continue": True}), "messages"),  # continue needs a final assistant message
        (generate("x", messages=[*USER, {"role": "assistant", "content": "  "}], **{"continue": True}), "messages"),
        (generate("x", **{"continue": 1}), "continue"),
        (generate("x", stop="###"), "stop"),
        (generate("x", colour="red"), "colour"),
        (generate("x" * 65), "id"),
    ],
)
def test_bad_message_names_the_field(client: TestClient, stack: ExitStack, msg: dict[str, Any], field: str) -> None:
    ws = connect(client, stack)
    ws.send_json(msg)
    err = p.Error.model_validate(ws.receive_json())
    assert err.code == "bad_message", err
    assert f"'{field}'" in err.message, err.message
    assert err.id == (msg["id"] if isinstance(msg.get("id"), str) and len(msg["id"]) <= 64 else None)
    assert_still_works(ws)


@pytest.mark.parametrize(
    ("msg", "field", "value", "allowed"),
    [
        (generate("x", settings={"temperature": 9.5}), "settings.temperature", "9.5", "0.0 <= value <= 5.0"),
        (generate("x", settings={"top_p": 0.0}), "settings.top_p", "0.0", "0.0 < value <= 1.0"),
        (generate("x", settings={"top_k": -1}), "settings.top_k", "-1", "0 <= value <= 100000"),
        (generate("x", settings={"seed": -5}), "settings.seed", "-5", "0 <= value"),
        (generate("x", settings={"token_bias": {"3": 500}}), "settings.token_bias.3", "500", "<= 100.0"),
        (generate("x", settings={"token_bias": {"99999": 1}}), "settings.token_bias", "99999", "in [0, "),
        (generate("x", settings={"token_bias": {"\u00b2": 1}}), "settings.token_bias", "\u00b2", "ASCII digits"),
        (generate("x", settings={"token_bias": {"\u0663": 1}}), "settings.token_bias", "\u0663", "ASCII digits"),
        (generate("x", settings={"token_bias": {"7" * 3000: 1}}), "settings.token_bias", "7777", "ASCII digits"),
        (generate("x", alternatives=21), "alternatives", "21", "0 <= value <= 20"),
        (generate("x", max_new_tokens=0), "max_new_tokens", "0", "1 <= value"),
        (generate("x", speculative="warp"), "speculative", "'warp'", "['auto', 'none', 'self', 'ngram']"),
    ],
)
def test_bad_settings_names_field_value_and_range(
    client: TestClient, stack: ExitStack, msg: dict[str, Any], field: str, value: str, allowed: str
) -> None:
    ws = connect(client, stack)
    ws.send_json(msg)
    err = p.Error.model_validate(ws.receive_json())
    assert err.code == "bad_settings" and err.id == "x", err
    assert field in err.message and value in err.message and allowed in err.message, err.message
    assert_still_works(ws)


def test_too_large(client: TestClient, stack: ExitStack) -> None:
    ws = connect(client, stack)
    ws.send_json(generate("big", messages=[{"role": "user", "content": "x" * 5000}]))
    err = p.Error.model_validate(ws.receive_json())
    assert err.code == "too_large" and "4096" in err.message, err
    assert_still_works(ws)


def test_prompt_too_long_names_the_numbers(client: TestClient, stack: ExitStack, runtime: Runtime) -> None:
    ws = connect(client, stack)
    long_messages = [{"role": "user", "content": "Hello there world " * 100}]
    n = len(runtime.encode_chat(long_messages))
    ws.send_json(generate("long", messages=long_messages, max_new_tokens=16))
    err = p.Error.model_validate(ws.receive_json())
    assert err.code == "prompt_too_long" and err.id == "long", err
    assert err.message.startswith(f"prompt is {n} tokens; the context of 256 allows at most 255"), err.message
    # a prompt that fits without room for max_new_tokens runs and ends at context_full (tests/serve/test_hardening.py)
    assert_still_works(ws)


def test_busy_connection(slow_client: TestClient, stack: ExitStack) -> None:
    ws = connect(slow_client, stack)
    ws.send_json(generate("first", max_new_tokens=100))
    assert ws.receive_json()["type"] == "start"
    ws.send_json(generate("second"))
    seen, err = run_to_end(ws, "second")
    assert err["type"] == "error" and err["code"] == "busy_connection" and "'first'" in err["message"], err
    ws.send_json({"type": "stop", "id": "first"})
    _, done = run_to_end(ws, "first")
    assert done["reason"] == "cancelled"
    assert_still_works(ws)


def test_busy_when_the_queue_is_full(config: ServerConfig, runtime: Runtime) -> None:
    with make_client(config, runtime, delay=0.05, max_sessions=1, max_queue=0) as c, ExitStack() as stack:
        first, second = connect(c, stack), connect(c, stack)
        first.send_json(generate("one", max_new_tokens=100))
        assert first.receive_json()["type"] == "start"
        second.send_json(generate("two"))
        err = p.Error.model_validate(second.receive_json())
        assert err.code == "busy" and err.id == "two" and "max 0" in err.message, err
        first.send_json({"type": "stop", "id": "one"})
        run_to_end(first, "one")
        assert_still_works(second)  # the slot is free again


def test_internal_error_ends_the_request_not_the_server(config: ServerConfig, runtime: Runtime) -> None:
    with make_client(config, runtime, gen_type=Exploding) as c, ExitStack() as stack:
        ws = connect(c, stack)
        _, err = run_to_end_after_send(ws, generate("boom"))
        assert err["type"] == "error" and err["code"] == "internal" and "device on fire" in err["message"], err
        _, err2 = run_to_end_after_send(ws, generate("boom2"))  # the connection still answers
        assert err2["code"] == "internal"


# ---------------------------------------------------------------- the page, origins
def test_page_has_context_and_a_strict_csp(client: TestClient, runtime: Runtime) -> None:
    page = client.get("/")
    assert page.status_code == 200
    assert f"<title>{runtime.model_name}</title>" in page.text and "<p id=ctx>256</p>" in page.text
    version = re.search(r"app\.js\?v=([0-9a-f]{12})", page.text)
    assert version is not None, page.text
    csp = page.headers["content-security-policy"]
    directives = dict(d.strip().split(" ", 1) for d in csp.split(";"))
    assert directives["script-src"] == "'self'" and "unsafe-inline" not in csp
    assert directives["object-src"] == "'none'" and "ws://testserver" in directives["connect-src"]
    assert client.get(f"/static/app.js?v={version.group(1)}").text == "export const x = 1;\n"
    assert client.get("/static/missing.js").status_code == 404


@pytest.mark.parametrize("origin", ["http://evil.example", "null", "http://testserver.evil.example"])
def test_foreign_origin_refused_with_403(client: TestClient, origin: str) -> None:
    with pytest.raises(WebSocketDenialResponse) as info:
        with client.websocket_connect("/ws", headers={"origin": origin}):
            pass
    assert info.value.status_code == 403


def test_same_origin_and_allowlisted_origins_accepted(config: ServerConfig, runtime: Runtime) -> None:
    with make_client(config, runtime, allow_origins=("http://localhost:3000",)) as c:
        for url, origin in [("ws://127.0.0.1:8000/ws", "http://127.0.0.1:8000"),
                            ("ws://localhost:8000/ws", "http://localhost:8000"),
                            ("/ws", "http://localhost:3000"), ("/ws", None)]:
            headers = {"origin": origin} if origin else {}
            with c.websocket_connect(url, headers=headers) as ws:
                assert ws.receive_json()["type"] == "hello"
        # same-origin to a non-loopback name while bound to loopback: a DNS-rebinding page
        with pytest.raises(WebSocketDenialResponse):
            with c.websocket_connect("ws://rebind.example:8000/ws", headers={"origin": "http://rebind.example:8000"}):
                pass


def test_disconnect_while_running_frees_the_session(slow_client: TestClient) -> None:
    with slow_client.websocket_connect("/ws") as ws:
        assert ws.receive_json()["type"] == "hello"
        ws.send_json(generate("gone", max_new_tokens=200))
        assert ws.receive_json()["type"] == "start"
        assert slow_client.get("/healthz").json()["active"] == 1
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        health = slow_client.get("/healthz").json()
        if health["active"] == 0 and health["sessions"] == 0:
            break
        time.sleep(0.02)
    health.pop("kv_pool")
    assert health == {"status": "ok", "active": 0, "queued": 0, "sessions": 0}


def test_server_messages_round_trip_through_dump() -> None:
    chunk = p.Chunk(id="r", text="Hi", tokens=[p.TokenOut(id=5, text="Hi", p=0.5, rank=1,
                                                          top=[p.Alternative(id=5, text="Hi", p=0.5)])])
    assert p.Chunk.model_validate_json(p.dump(chunk)) == chunk
    plain = json.loads(p.dump(p.Chunk(id="r", text="x")))
    assert plain == {"type": "chunk", "id": "r", "text": "x"}
    merged = p.Chunk(id="r", text="a").merged(p.Chunk(id="r", text="b"))
    assert merged.text == "ab" and merged.tokens is None
    err = json.loads(p.dump(p.Error(id=None, code="bad_json", message="m")))
    assert err == {"type": "error", "id": None, "code": "bad_json", "message": "m"}


def test_the_real_page_renders_with_its_assets(config: ServerConfig, runtime: Runtime) -> None:
    real = ServerConfig(model_dir=config.model_dir, device="cpu")
    assert (real.templates_dir / "index.html").is_file(), real.templates_dir
    with make_client(real, runtime) as c:
        page = c.get("/")
        assert page.status_code == 200 and "content-security-policy" in page.headers
        assert "<script>" not in page.text and " on" + "click=" not in page.text  # no inline script or handler
        assets = re.findall(r'(?:src|href)="(/static/[^"]+)"', page.text)
        assert any(a.startswith("/static/app.js?v=") for a in assets), assets
        for asset in assets:
            assert c.get(asset).status_code == 200, asset


def test_sessions_are_kept_between_turns_and_evicted_least_recently_used(
    config: ServerConfig, runtime: Runtime
) -> None:
    with make_client(config, runtime, max_sessions=2, max_queue=2) as c, ExitStack() as stack:
        a, b, d = connect(c, stack), connect(c, stack), connect(c, stack)
        prompt = [{"role": "user", "content": "sessions test: " + "one two three four " * 8}]
        n_prompt = len(runtime.encode_chat(prompt))

        runtime.engine.reset()  # no prefix cached by earlier tests: a1 starts cold

        def reused(ws: Any, rid: str, messages: list[dict[str, str]] = prompt) -> int:
            seen, done = run_to_end_after_send(ws, generate(rid, max_new_tokens=3, messages=messages))
            assert done["type"] == "done", done
            return int(seen[0]["reused_tokens"])

        assert reused(a, "a1") == 0
        shared = reused(b, "b1")  # another tab, the same prompt: its whole pages were computed once, by a
        assert 0 < shared <= n_prompt - 1  # to the token: a's pages hold b's prompt (its last page copied)
        assert reused(a, "a2") == n_prompt  # a's own last turn: all of it (the first token from the kept logits)
        assert c.get("/healthz").json()["sessions"] == 2
        other = [{"role": "user", "content": "something else entirely " * 4}]
        ids, other_ids = runtime.encode_chat(prompt), runtime.encode_chat(other)
        opening = next(i for i, (x, y) in enumerate(zip(ids, other_ids, strict=False)) if x != y)  # the template's
        assert reused(d, "d1", other) == opening  # a third session: b, the least recently used idle one, is closed
        assert c.get("/healthz").json()["sessions"] == 2
        assert reused(a, "a3") == n_prompt  # a survived
        reused(b, "b2")  # b's own turn is gone (a's pages still hold its prompt: reused from them, to the token)
        assert c.get("/healthz").json()["sessions"] == 2  # d, now the least recently used, made room


def test_outbox_merges_chunks_of_a_slow_reader() -> None:
    asyncio.run(outbox_merges())


async def outbox_merges() -> None:
    from webchat.serve.outbox import Outbox

    box = Outbox()
    tok = p.TokenOut(id=1, text="a", p=0.5, rank=1, top=[])
    box.push(p.Start(id="r", prompt_tokens=3, reused_tokens=0))
    box.push(p.Chunk(id="r", text="a", tokens=[tok]))
    box.push(p.Chunk(id="r", text="b", tokens=[tok, tok]))
    box.push(p.Chunk(id="r", text="c", tokens=[]))
    box.push(p.Done(id="r", reason="max_new_tokens", stats=p.Stats()))
    items = await box.take()
    assert [m.type for m in items] == ["start", "chunk", "done"]
    merged = items[1]
    assert isinstance(merged, p.Chunk) and merged.text == "abc" and merged.tokens == [tok, tok, tok]
    assert box.merged == 2
    box.push(p.Chunk(id="r", text="x"))
    assert [m.type for m in await box.take()] == ["chunk"]


def test_serve_command_warns_off_loopback_and_prints_the_url(
    tiny_model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import argparse

    from webchat.cli.serve import add_arguments, main

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    calls: list[dict[str, Any]] = []

    def fake_run(app: Any, **kwargs: Any) -> None:
        calls.append(kwargs)
        with TestClient(app, base_url="http://127.0.0.1:8000") as c:  # the lifespan loads the model, prints the URL
            assert c.get("/healthz").json()["status"] == "ok"
            assert c.get("/healthz", headers={"host": "rebound.example:8000"}).status_code == 403  # Host checked

    args = parser.parse_args(["--model", str(tiny_model_dir), "--device", "cpu", "--max-sessions", "3"])
    assert main(args, run=fake_run) == 0
    out, err = capsys.readouterr()
    assert "ready at http://127.0.0.1:8000/" in out and "WARNING" not in err
    assert calls[0]["host"] == "127.0.0.1" and calls[0]["port"] == 8000
    args = parser.parse_args(["--model", str(tiny_model_dir), "--device", "cpu", "--host", "0.0.0.0", "--port", "9"])
    assert main(args, run=lambda app, **kw: calls.append(kw)) == 2  # off loopback only with --allow-origin
    assert "refusing to bind to 0.0.0.0, which is not loopback, without --allow-origin" in capsys.readouterr().err
    args = parser.parse_args(["--model", str(tiny_model_dir), "--device", "cpu", "--host", "0.0.0.0", "--port", "9",
                              "--allow-origin", "http://chat.example:9"])
    assert main(args, run=lambda app, **kw: calls.append(kw)) == 0
    assert "WARNING: bound to 0.0.0.0, not loopback" in capsys.readouterr().err
    assert calls[-1]["host"] == "0.0.0.0" and calls[-1]["port"] == 9
    with pytest.raises(SystemExit):
        parser.parse_args(["--max-sessions", "0"])
    assert main(parser.parse_args(["--speculative", "draft"]), run=fake_run) == 2


def test_wire_settings_mirror_sampling_settings() -> None:
    # the two are kept apart on purpose (wire vs internal); their names, defaults and ranges must not drift
    import dataclasses

    from annotated_types import Ge, GroupedMetadata, Gt, Le

    from webchat.engine.settings import SamplingSettings, SettingsError

    internal = {f.name: f for f in dataclasses.fields(SamplingSettings)}
    assert list(p.WireSettings.model_fields) == list(internal)
    defaults = SamplingSettings()
    for name, info in p.WireSettings.model_fields.items():
        assert info.get_default(call_default_factory=True) == getattr(defaults, name), name
        bounds = {type(c): c for m in info.metadata for c in (m if isinstance(m, GroupedMetadata) else [m])}
        if name in ("token_bias", "seed"):
            continue
        lo = bounds[Ge].ge if Ge in bounds else bounds[Gt].gt
        hi = bounds[Le].le
        SamplingSettings(**{name: hi})
        SamplingSettings(**{name: lo if Ge in bounds else lo + (1 if isinstance(lo, int) else 1e-6)})
        step = 1 if info.annotation is int else 1e-3
        for outside in (hi + step, lo - step if Ge in bounds else lo):
            with pytest.raises(SettingsError, match=name):
                SamplingSettings(**{name: outside})


# ---------------------------------------------------------------- continue a partial assistant message
def test_continue_goes_on_from_the_partial_reply(client: TestClient, stack: ExitStack, runtime: Runtime) -> None:
    """A reply continued from its first part is the greedy continuation of the prompt that ends in that part."""
    from webchat.engine.sequence import GenerationRequest
    from webchat.engine.settings import SamplingSettings

    ws = connect(client, stack)
    _, first = run_to_end_after_send(ws, generate("whole", max_new_tokens=12, alternatives=1))
    assert first["type"] == "done", first
    partial = "Once upon"
    msgs = [*USER, {"role": "assistant", "content": partial}]
    seen, done = run_to_end_after_send(ws, generate("cont", messages=msgs, max_new_tokens=6, **{"continue": True}))
    assert done["type"] == "done", done
    text = runtime.tokenizer.apply_chat_template(USER, add_generation_prompt=True) + partial
    ids = runtime.tokenizer.encode(text)
    assert runtime.encode_chat(msgs, continue_final=True) == ids
    start = next(m for m in seen if m["type"] == "start")
    assert start["prompt_tokens"] == len(ids), (start, len(ids))
    gen = runtime.new_generator()
    gen.begin_stream(GenerationRequest(prompt_ids=ids, settings=SamplingSettings(temperature=0.0), max_new_tokens=6))
    want = ""
    while True:
        res = gen.stream()
        want += str(res.text)
        if res.eos:
            break
    assert "".join(m["text"] for m in seen if m["type"] == "chunk") == want  # only the new text is streamed


def test_continue_refuses_a_template_that_drops_the_final_message(config: ServerConfig, runtime: Runtime) -> None:
    tok = copy.copy(runtime.tokenizer)  # a template that leaves assistant messages out
    tok.chat_template = "{% for m in messages %}{% if m.role == 'user' %}{{ m.content }}{% endif %}{% endfor %}"
    rt = replace(runtime, tokenizer=tok)
    with TestClient(create_app(config, runtime=rt)) as c, c.websocket_connect("/ws") as ws:
        assert ws.receive_json()["type"] == "hello"
        msgs = [*USER, {"role": "assistant", "content": "zzz partial"}]
        ws.send_json(generate("c", messages=msgs, **{"continue": True}))
        err = p.Error.model_validate(ws.receive_json())
        assert err.code == "bad_message" and "'continue'" in err.message, err


def test_a_lone_surrogate_id_is_answered_in_a_safe_form_and_the_socket_stays_open(client: TestClient,
                                                                                  stack: ExitStack) -> None:
    ws = connect(client, stack)
    ws.send_text('{"type": "generate", "id": "r\\ud800", "messages": [{"role": "user", "content": "Hi"}]}')
    err = ws.receive_json()
    assert err["type"] == "error" and err["code"] == "bad_message" and err["id"] == "r\\ud800", err
    assert "lone surrogate" in err["message"]
    assert_still_works(ws)


def test_a_lone_surrogate_in_content_is_refused_by_name(client: TestClient, stack: ExitStack) -> None:
    ws = connect(client, stack)
    ws.send_text('{"type": "generate", "id": "s", "messages": [{"role": "user", "content": "a\\udc00"}]}')
    err = ws.receive_json()
    assert err["code"] == "bad_message" and err["id"] == "s" and "messages.0.content" in err["message"], err
    assert_still_works(ws)


def test_the_wire_settings_take_their_bounds_and_defaults_from_the_engine_s_table() -> None:
    """One home for the sampling ranges: every field of RANGES is declared on the wire with the same bounds and the
    engine's default, and a value just outside is refused by both."""
    from webchat.engine.settings import RANGES, SamplingSettings, SettingsError

    props = p.WireSettings.model_json_schema()["properties"]
    default = SamplingSettings()
    for name, r in RANGES.items():
        schema = props[name] if "anyOf" not in props[name] else props[name]["anyOf"][0]
        assert schema["maximum"] == r.hi, name
        assert schema.get("exclusiveMinimum" if r.lo_open else "minimum") == r.lo, name
        assert p.WireSettings().model_dump()[name] == getattr(default, name), name
        for bad in ((r.lo if r.lo_open else r.lo - 1), r.hi + 1):
            bad = int(bad) if r.integer else float(bad)
            with pytest.raises(ValueError):
                p.WireSettings.model_validate({name: bad})
            with pytest.raises(SettingsError, match=name):
                SamplingSettings(**{name: bad})
