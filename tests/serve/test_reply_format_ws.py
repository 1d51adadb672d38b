"""The websocket's `generate.response_format` (docs/protocol.md) on a live server (tiny model): the reply is valid
under the schema, its tokens name the alternatives the grammar forbade, Continue with the reply's own token ids
keeps the format, and a schema the grammar library refuses is `bad_message` naming it."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from live_server import Live, serve  # tests/ is on sys.path under pytest
from websockets.sync.client import connect as sync_connect

from webchat.serve.config import ServerConfig
from webchat.serve.runtime import load_runtime

pytestmark = pytest.mark.timeout(180)
SCHEMA = {"type": "object", "properties": {"word": {"type": "string", "maxLength": 6},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["word", "n"], "additionalProperties": False}
FORMAT = {"type": "json_schema", "json_schema": {"name": "w", "schema": SCHEMA}}


@pytest.fixture(scope="module")
def live(tiny_model_dir: Path) -> Iterator[Live]:
    config = ServerConfig(model_dir=tiny_model_dir, device="cpu", max_sessions=2, max_queue=4, max_seq_len=512)
    with serve(config, load_runtime(config)) as server:
        yield server


def generate(live: Live, messages: list[dict[str, str]], **extra: Any) -> list[dict[str, Any]]:
    with sync_connect(live.url.replace("http", "ws") + "/ws") as ws:
        assert json.loads(ws.recv(10))["type"] == "hello"
        ws.send(json.dumps({"type": "generate", "id": "g", "messages": messages, "max_new_tokens": 200,
                            "settings": {"temperature": 1.0, "seed": 5, "top_k": 0, "top_p": 1.0, "min_p": 0.0},
                            **extra}))
        out = []
        while (msg := json.loads(ws.recv(60)))["type"] not in ("done", "error"):
            out.append(msg)
        return [*out, msg]


def test_a_reply_follows_its_format_and_names_what_was_forbidden(live: Live) -> None:
    msgs = generate(live, [{"role": "user", "content": "Go"}], alternatives=10, response_format=FORMAT)
    assert msgs[-1]["type"] == "done" and msgs[-1]["reason"] == "stop_token"
    text = "".join(m["text"] for m in msgs if m["type"] == "chunk")
    jsonschema.validate(json.loads(text), SCHEMA)
    tokens = [t for m in msgs if m["type"] == "chunk" for t in m["tokens"]]
    marked = [t for t in tokens if t.get("forbidden")]
    assert marked, "a random model's likeliest tokens are mostly not JSON: some must be marked"
    for t in marked:
        assert set(t["forbidden"]) <= {a["id"] for a in t["top"]} and t["id"] not in t["forbidden"]
    free = generate(live, [{"role": "user", "content": "Go"}], alternatives=10)
    assert all("forbidden" not in t for m in free if m["type"] == "chunk" for t in m["tokens"])


def test_continue_on_the_replys_own_ids_keeps_the_format(live: Live) -> None:
    msgs = generate(live, [{"role": "user", "content": "Go"}], alternatives=1, response_format=FORMAT)
    tokens = [t for m in msgs if m["type"] == "chunk" for t in m["tokens"]]
    whole = "".join(t["text"] for t in tokens)
    k = len(tokens) // 2
    kept = "".join(t["text"] for t in tokens[:k])
    rest = generate(live, [{"role": "user", "content": "Go"}, {"role": "assistant", "content": kept}],
                    response_format=FORMAT, prefix_ids=[t["id"] for t in tokens[:k]], **{"continue": True})
    assert rest[-1]["type"] == "done"
    jsonschema.validate(json.loads(kept + "".join(m["text"] for m in rest if m["type"] == "chunk")), SCHEMA)
    assert json.loads(whole)  # the first reply was whole too


@pytest.mark.parametrize(("fmt", "words"), [
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "if": {}}}},
     'Unimplemented keys: ["if"]'),
    ({"type": "json_schema", "json_schema": {"name": "x"}}, "needs response_format.json_schema.schema"),
    ({"type": "xml"}, "response_format.type"),
])
def test_a_format_that_cannot_be_is_named(live: Live, fmt: dict[str, Any], words: str) -> None:
    msgs = generate(live, [{"role": "user", "content": "Go"}], response_format=fmt)
    assert msgs[-1]["type"] == "error" and msgs[-1]["code"] == "bad_message" and msgs[-1]["id"] == "g"
    assert words in msgs[-1]["message"]


def test_a_kept_reply_that_breaks_the_format_is_refused(live: Live) -> None:
    msgs = generate(live, [{"role": "user", "content": "Go"}, {"role": "assistant", "content": "Hello"}],
                    response_format=FORMAT, **{"continue": True})
    assert msgs[-1]["type"] == "error" and msgs[-1]["code"] == "bad_message"
    assert "does not follow the reply's format" in msgs[-1]["message"]


def test_the_api_continues_a_final_message_under_its_format(live: Live) -> None:
    """continue_final_message with a response_format: the kept reply is replayed into the grammar, so the
    continuation completes that object instead of starting another."""
    import httpx

    kept = '{"word": "ab'
    body: dict[str, Any] = {
            "messages": [{"role": "user", "content": "Go"}, {"role": "assistant", "content": kept}],
            "continue_final_message": True, "add_generation_prompt": False, "max_tokens": 200, "seed": 2,
            "response_format": FORMAT}
    body["model"] = httpx.get(f"{live.url}/v1/models").json()["data"][0]["id"]
    reply = httpx.post(f"{live.url}/v1/chat/completions", json=body, timeout=60).json()
    assert reply["choices"][0]["finish_reason"] == "stop", reply
    jsonschema.validate(json.loads(kept + reply["choices"][0]["message"]["content"]), SCHEMA)
