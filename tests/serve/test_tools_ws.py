"""The websocket's tools (issue 66) on a served tiny model and a real MCP server over stdio (tests/mcp/toolserver.py):
the servers listed, a forced call parsed with where it is in the reply, call_tool checked and run, stop, a time limit,
a crash, a huge result, HTML kept as text."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from live_server import Live
from tools_live import client, descendants, served, write_config

from webchat.mcp.result import DEFAULT_MAX_RESULT_CHARS
from webchat.serve.config import ServerConfig
from webchat.serve.runtime import Runtime, load_runtime

pytestmark = pytest.mark.timeout(180)
HTML = '<b>bold</b><script>alert("x")</script> & <img src=x onerror=alert(1)> \u00e9\u4e2d'


@pytest.fixture(scope="module")
def config(tiny_model_dir: Path) -> ServerConfig:
    return ServerConfig(model_dir=tiny_model_dir, device="cpu", max_sessions=8, max_queue=8, max_seq_len=4096)


@pytest.fixture(scope="module")
def runtime(config: ServerConfig) -> Runtime:
    return load_runtime(config)


@pytest.fixture(scope="module")
def live(config: ServerConfig, runtime: Runtime, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Live]:
    path = write_config(tmp_path_factory.mktemp("mcp") / "mcp.json", t=60.0, q=3.0)  # q: a 3 s limit
    with served(config, runtime, path) as live:
        yield live


def test_hello_is_followed_by_the_servers_and_their_tools(live: Live) -> None:
    with client(live) as c:
        assert c.hello["type"] == "hello"
        tools = c.ready()
        server = tools["servers"][0]
        assert [s["name"] for s in tools["servers"]] == ["t", "q"] and server["transport"] == "stdio"
        names = {t["name"] for t in server["tools"]}
        assert {"t__add", "t__pid", "t__sleep", "t__crash", "t__big", "t__html"} <= names
        add = next(t for t in server["tools"] if t["name"] == "t__add")
        assert add["tool"] == "add" and add["description"] == "Add two integers."
        assert add["parameters"]["required"] == ["a", "b"] and 10 < add["tokens"] < 1000
        assert tools["max_result_chars"] == DEFAULT_MAX_RESULT_CHARS


def test_a_forced_call_comes_back_in_done_with_its_span_and_runs(live: Live) -> None:
    with client(live) as c:
        c.ready()
        c.send(type="generate", id="g1", messages=[{"role": "user", "content": "which process are you?"}],
               max_new_tokens=200, alternatives=2, tools=["t__pid", "t__add"],
               tool_choice={"type": "function", "function": {"name": "t__pid"}})
        text, tokens = "", []
        while (msg := c.next("chunk", "done", "error", rid="g1"))["type"] == "chunk":
            text += msg["text"]
            tokens += msg["tokens"]
        assert msg["type"] == "done", msg
        [call] = msg["tool_calls"]
        assert call["function"] == {"name": "t__pid", "arguments": "{}"} and call["id"].startswith("call_")
        start, end = call["span"]
        assert text[start:end].startswith("<tool_call>") and text[start:end].endswith("</tool_call>")
        assert json.loads(text[start:end].removeprefix("<tool_call>").removesuffix("</tool_call>"))["name"] == "t__pid"
        assert "".join(t["text"] for t in tokens) == text and all(0 <= t["p"] <= 1 for t in tokens)
        result = c.call("c1", "t__pid", {})
        assert result["type"] == "tool_result" and not result["is_error"] and result["error"] is None
        assert int(result["text"]) in descendants()  # a real server process, started by this server


def test_call_tool_refuses_what_was_not_listed_enabled_or_an_object(live: Live) -> None:
    with client(live) as c:
        c.ready()
        assert c.enable("g1", "t__pid")["type"] == "done"
        refused = {
            "unknown_tool": c.call("c1", "t__nope", {}),
            "tool_not_enabled": c.call("c2", "t__add", {"a": 1, "b": 2}),
        }
        c.send(type="call_tool", id="c3", name="t__pid", arguments="[1, 2]")
        refused["bad_arguments"] = c.next("error", rid="c3")
        c.send(type="call_tool", id="c4", name="t__pid", arguments="not json")
        not_json = c.next("error", rid="c4")
        for code, msg in refused.items():
            assert msg["type"] == "error" and msg["code"] == code, msg
        assert "expected a JSON object, got list [1, 2]" in refused["bad_arguments"]["message"]
        assert not_json["code"] == "bad_arguments" and "not JSON" in not_json["message"]
        assert "t__nope" in refused["unknown_tool"]["message"]
        c.send(type="generate", id="g2", messages=[{"role": "user", "content": "hi"}], tools=["t__nope"])
        unknown = c.next("error", rid="g2")
        assert unknown["code"] == "unknown_tool" and "tools.0" in unknown["message"]
        c.send(type="generate", id="g3", messages=[{"role": "user", "content": "hi"}], tool_choice="required")
        assert "tool_choice" in c.next("error", rid="g3")["message"]
        c.send(type="generate", id="g4", messages=[{"role": "user", "content": "hi"}], max_new_tokens=1)
        assert c.next("done", "error", rid="g4")["type"] == "done"  # no tools: none is enabled any more
        assert c.call("c5", "t__pid", {})["code"] == "tool_not_enabled"


def test_stop_cancels_a_running_call_and_its_server_is_told(live: Live, tmp_path: Path) -> None:
    marker = tmp_path / "marker"
    with client(live) as c:
        c.ready()
        c.enable("g1", "t__sleep", "t__pid")
        c.send(type="call_tool", id="c1", name="t__sleep", arguments=json.dumps({"seconds": 600,
                                                                                "marker": str(marker)}))
        deadline = time.monotonic() + 30
        while not (marker.exists() and marker.read_text() == "started"):
            assert time.monotonic() < deadline, "the call never started"
            time.sleep(0.02)
        c.send(type="call_tool", id="c2", name="t__pid", arguments="{}")
        assert c.next("error", rid="c2")["code"] == "busy_connection"
        c.send(type="stop", id="c1")
        result = c.next("tool_result", rid="c1")
        assert result["error"] == "cancelled" and result["is_error"] and result["ms"] < 30_000
        while marker.read_text() != "cancelled":  # the SDK sent notifications/cancelled
            assert time.monotonic() < deadline, f"the server was not told: marker {marker.read_text()!r}"
            time.sleep(0.02)
        assert c.call("c3", "t__pid", {})["type"] == "tool_result"  # the connection is free again


def test_a_call_past_its_time_limit_is_that_calls_timeout(live: Live) -> None:
    with client(live) as c:
        c.ready("q")
        c.enable("g1", "q__sleep")
        result = c.call("c1", "q__sleep", {"seconds": 600})
        assert result["error"] == "timeout" and "within 3 s" in result["text"], result
        assert 3000 <= result["ms"] < 30_000


def test_a_server_that_dies_mid_call_is_that_calls_error_and_comes_back(live: Live) -> None:
    with client(live) as c:
        c.ready()
        c.enable("g1", "t__crash", "t__pid")
        first = int(c.call("c0", "t__pid", {})["text"])
        seen = len(c.tools)
        result = c.call("c1", "t__crash", {})
        assert result["type"] == "tool_result" and result["error"] == "server_died", result
        while not any(s["state"] != "ready" for m in c.tools[seen:] for s in m["servers"]):
            c.next("tools")  # the page is told it went
        c.ready()  # and that it is back (restarted by the manager)
        again = c.call("c2", "t__pid", {})
        assert again["type"] == "tool_result" and int(again["text"]) != first


def test_a_huge_result_is_cut_with_a_note_and_html_stays_text(live: Live) -> None:
    with client(live) as c:
        c.ready()
        c.enable("g1", "t__big", "t__html")
        big = c.call("c1", "t__big", {"chars": 10_000_000})
        assert big["truncated"] and big["total_chars"] == 10_000_000
        assert big["text"].startswith("0123456789")
        assert "[truncated: the result was 10,000,000 characters" in big["text"]
        assert len(big["text"]) < DEFAULT_MAX_RESULT_CHARS + 200
        html = c.call("c2", "t__html", {})
        assert html["text"] == HTML and not html["is_error"]


def test_a_server_without_mcp_config_refuses_tools(config: ServerConfig, runtime: Runtime) -> None:
    with served(config, runtime, None) as live, client(live) as c:
        c.send(type="generate", id="g1", messages=[{"role": "user", "content": "hi"}], tools=["t__pid"])
        assert "--mcp-config" in c.next("error", rid="g1")["message"]
        c.send(type="call_tool", id="c1", name="t__pid", arguments="{}")
        refused = c.next("error", rid="c1")
        assert refused["code"] == "bad_message" and "--mcp-config" in refused["message"]
        assert c.tools == []


def test_a_continued_call_is_parsed_from_its_kept_text(live: Live) -> None:
    kept = '<tool_call>\n{"name": "t__add", "arguments": {"a": 1'
    with client(live) as c:
        c.ready()
        c.send(type="generate", id="g1", max_new_tokens=200, tools=["t__add"], **{"continue": True},
               messages=[{"role": "user", "content": "add"}, {"role": "assistant", "content": kept}])
        text = ""
        while (msg := c.next("chunk", "done", "error", rid="g1"))["type"] == "chunk":
            text += msg["text"]
        assert msg["type"] == "done", msg
        [call] = msg["tool_calls"]
        start, end = call["span"]
        assert start == 0 and (kept + text)[start:end].endswith("</tool_call>")
        arguments = json.loads(call["function"]["arguments"])
        assert arguments["a"] == 1 and set(arguments) == {"a", "b"} and isinstance(arguments["b"], int)


def test_tools_that_fill_the_context_say_so(config: ServerConfig, tmp_path: Path) -> None:
    from dataclasses import replace

    small = replace(config, max_seq_len=1024)
    with served(small, load_runtime(small), write_config(tmp_path / "mcp.json")) as live, client(live) as c:
        names = [t["name"] for t in c.ready()["servers"][0]["tools"]]
        c.send(type="generate", id="g1", messages=[{"role": "user", "content": "hi"}], max_new_tokens=16,
               tools=names)
        refused = c.next("error", rid="g1")
        assert refused["code"] == "prompt_too_long", refused
        assert "the tools switched on take about" in refused["message"]


def test_a_remote_engine_gets_the_tools_and_its_calls_are_parsed(live: Live, tmp_path: Path) -> None:
    from live_server import free_port, uvicorn_thread

    from webchat.serve.app import create_app

    port = free_port()
    cfg = ServerConfig(model_dir=Path("."), port=port, engine_url=live.url,
                       mcp_config=write_config(tmp_path / "m.json"))
    with uvicorn_thread(create_app(cfg), port) as url:
        front = Live(url, url.replace("http://", "ws://") + "/ws", None, live.probe)
        with client(front) as c:
            c.ready()
            c.send(type="generate", id="g1", messages=[{"role": "user", "content": "pid?"}], max_new_tokens=200,
                   tools=["t__pid"], tool_choice={"type": "function", "function": {"name": "t__pid"}})
            text = ""
            while (msg := c.next("chunk", "done", "error", rid="g1"))["type"] == "chunk":
                text += msg["text"]
            assert msg["type"] == "done", msg
            [call] = msg["tool_calls"]
            assert call["function"]["name"] == "t__pid" and json.loads(call["function"]["arguments"]) == {}
            assert text[call["span"][0] : call["span"][1]].startswith("<tool_call>")
            assert c.call("c1", "t__pid", {})["type"] == "tool_result"


def test_the_servers_start_and_stop_with_the_app(config: ServerConfig, runtime: Runtime, tmp_path: Path) -> None:
    before = descendants()
    with served(config, runtime, write_config(tmp_path / "mcp.json")) as live, client(live) as c:
        c.ready()
        c.enable("g", "t__pid")
        assert int(c.call("c0", "t__pid", {})["text"]) in descendants() - before
    assert descendants() <= before, "a server's process outlived the app"


def test_a_bad_config_file_stops_serve_before_anything_starts(tiny_model_dir: Path, tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    from webchat.cli.main import cli

    bad = tmp_path / "mcp.json"
    bad.write_text(json.dumps({"mcpServers": {"files": {"command": "npx", "args": ["-y", 3]}}}))
    assert cli(["serve", "--model", str(tiny_model_dir), "--device", "cpu", "--mcp-config", str(bad)]) == 2
    err = capsys.readouterr().err
    assert f"{bad}: mcpServers.files.args[1]" in err and "got a number" in err, err
