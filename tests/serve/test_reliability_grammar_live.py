"""Issue 63 against a real `webchat serve` child (tests/live_child.py): the four requests that killed the server
(rows 1-4) are 400s naming the bound and the server keeps serving; the lows (rows 10-15) are 4xx before generation,
or what the issue asks."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from grammars import defs_chain, lark_chain, nested
from live_child import Child, serve  # tests/ is on sys.path under pytest
from websockets.sync.client import connect

from bench.tiny import make_tiny_model

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
HI = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def shelf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("shelf")
    for name, seed in (("tiny-a", 0), ("tiny-b", 1), ("tiny-c", 2)):
        make_tiny_model(root / name, seed=seed, max_seq_len=2048)  # room for a tools prompt
    return root


@pytest.fixture(scope="module")
def child(shelf: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Child]:
    tmp = tmp_path_factory.mktemp("grammar-live")
    (tmp / "models").mkdir()
    for name in ("tiny-b", "tiny-c"):
        os.symlink(shelf / name, tmp / "models" / name)
    with serve(tmp, "--model", str(shelf / "tiny-a"), "--models-dir", str(tmp / "models"), "--max-models", "1") as c:
        yield c


def chat(c: Child, model: str = "tiny-a", **fields: Any) -> httpx.Response:
    body = {"model": model, "messages": HI, "max_tokens": 8, **fields}
    return httpx.post(f"{c.url}/v1/chat/completions", json=body, timeout=120)


def schema_format(schema: Any) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}


def alive(c: Child) -> None:
    assert c.proc.poll() is None, f"the server died: {c.text()[-2000:]}"
    assert chat(c, max_tokens=2).status_code == 200


# ---------------------------------------------------------------- rows 1-4: they killed the server
@pytest.mark.parametrize(("fields", "param", "says"), [
    ({"structured_outputs": {"grammar": lark_chain(3000)}}, "structured_outputs.grammar",
     "a chain of 3002 rules, each referring to the next"),
    ({"response_format": schema_format(defs_chain(2000))}, "response_format.json_schema.schema",
     "a chain of 4003 subschemas"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": defs_chain(2000)}}]},
     "tools.0.function.parameters", "a chain of 4003 subschemas"),
])
def test_a_chain_that_killed_the_server_is_a_400_naming_the_bound(child: Child, fields: dict[str, Any], param: str,
                                                                   says: str) -> None:
    r = chat(child, **fields)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and says in error["message"] and "at most 256 are allowed" in error["message"]
    alive(child)


def test_the_chain_on_the_websocket_is_bad_message_and_the_connection_goes_on(child: Child) -> None:
    """Row 3: any page on the loopback origin can send it."""
    with connect(child.url.replace("http://", "ws://") + "/ws", open_timeout=10) as ws:
        assert json.loads(ws.recv(10))["type"] == "hello"
        ws.send(json.dumps({"type": "generate", "id": "r", "messages": HI, "max_new_tokens": 4,
                            "response_format": schema_format(defs_chain(2000))}))
        error = json.loads(ws.recv(60))
        assert error["type"] == "error" and error["code"] == "bad_message" and error["id"] == "r"
        assert "a chain of 4003 subschemas" in error["message"]
        ws.send(json.dumps({"type": "generate", "id": "s", "messages": HI, "max_new_tokens": 2,
                            "settings": {"temperature": 0.0}}))
        while (msg := json.loads(ws.recv(60)))["type"] not in ("done", "error"):
            pass
        assert msg["type"] == "done"
    alive(child)


# ---------------------------------------------------------------- rows 10-13: 4xx before generation, never a 500
@pytest.mark.parametrize(("fields", "says"), [
    ({"response_format": schema_format(nested(900))}, "nests 257 or more levels deep"),  # row 10
    ({"response_format": schema_format({"$ref": "#"})}, "form a cycle that never reaches a value"),  # row 11
    ({"structured_outputs": {"regex": "a{1000000}"}}, "repeats a piece 1000000 times"),  # row 12
    ({"structured_outputs": {"regex": "(a{1000}){1000}"}}, "repeats a piece 1000000 times"),  # row 12
    ({"structured_outputs": {"grammar": "start: " + " | ".join(f'"w{i}"' for i in range(10000))}},  # row 13
     "Current row has 10001 items"),
])
def test_a_grammar_that_cannot_be_is_a_400_before_generation(child: Child, fields: dict[str, Any], says: str) -> None:
    r = chat(child, **fields)
    assert r.status_code == 400, r.text
    assert says in r.json()["error"]["message"]
    alive(child)


# ---------------------------------------------------------------- row 14: a length stop inside a forced call
def test_a_required_call_cut_by_max_tokens_gives_no_markup_as_content(child: Child) -> None:
    tools = [{"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"tz": {"type": "string"}}}}}]
    for max_tokens in (1, 2, 3, 5):
        r = chat(child, max_tokens=max_tokens, tool_choice="required", tools=tools, temperature=0.0)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert choice["finish_reason"] == "length"
        assert choice["message"]["content"] is None, choice["message"]


# ---------------------------------------------------------------- row 15: a request that failed holds no model
def test_a_request_that_failed_after_its_model_loaded_leaves_it_free(child: Child) -> None:
    """--max-models 1: tiny-b is loaded for a request whose reply format is refused; tiny-c right after loads (on
    main tiny-b stayed claimed for 10 s and tiny-c was model_busy)."""
    r = chat(child, model="tiny-b", response_format=schema_format({"$ref": "#"}))
    assert r.status_code == 400, r.text
    r = chat(child, model="tiny-c", max_tokens=2)
    assert r.status_code == 200, r.text
    assert chat(child, max_tokens=2).status_code == 200
