"""Tools that act (issue 66), in Chromium: `webchat serve --mcp-config` with three real MCP servers (the page's test
server, e2e/page_tools_server.py, over stdio and over streamable HTTP, and the published mcp-server-time over stdio).
The page lists their tools; a forced call is a card whose tokens are coloured by probability; Deny tells the model,
Allow runs the call and the model goes on with its result; a call past its time limit, a server that dies mid-call,
a 10 MB result and a result full of HTML are each that call's outcome, shown as text; Stop ends a running call; the
calls are kept, exported and imported with the conversation."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from playwright.sync_api import expect

if TYPE_CHECKING:
    from page_driver import ChatPage, Server

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

TOOLS_SERVER = Path(__file__).resolve().parent / "page_tools_server.py"
AXE = Path(__file__).resolve().parent / "vendor" / "axe.min.js"
DENIED = "The user denied this tool call; it was not run."
REPLY_TOKENS = "300"  # room for a forced call (whitespace is the model's), and a short reply after it
CALL_S = 60_000  # ms: a guard against a hang, never an expectation


class HttpTools:
    """The page's test server over streamable HTTP on a loopback socket handed to it (no race for the port)."""

    def __init__(self) -> None:
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        sock.listen(64)
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}/mcp"
        with sock:
            self.proc = subprocess.Popen([sys.executable, str(TOOLS_SERVER), "http", str(sock.fileno())],
                                         pass_fds=[sock.fileno()], stderr=subprocess.DEVNULL)

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=30)


@pytest.fixture(scope="module")
def tools_server(launch_tiny: Callable[..., Server], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    http = HttpTools()
    config = tmp_path_factory.mktemp("mcp") / "mcp.json"
    config.write_text(json.dumps({"mcpServers": {
        "local": {"command": sys.executable, "args": [str(TOOLS_SERVER), "stdio"]},
        "strict": {"command": sys.executable, "args": [str(TOOLS_SERVER), "stdio"], "timeout": 3},
        "web": {"url": http.url},
        "time": {"command": sys.executable, "args": ["-m", "mcp_server_time", "--local-timezone", "UTC"]},
    }}))
    server = launch_tiny("--mcp-config", str(config))
    yield server
    server.stop()
    http.stop()


@pytest.fixture
def tools_chat(tools_server: Server, new_page: Callable[..., ChatPage]) -> ChatPage:
    chat: ChatPage = new_page(tools_server)
    chat.set_settings(max_new_tokens=REPLY_TOKENS)
    return chat


def open_tools(chat: ChatPage) -> None:
    page = chat.page
    if page.get_by_test_id("tools-view").is_hidden():
        page.get_by_test_id("tools-open").click()
    expect(page.locator("[data-testid=tools-server][data-state=ready]")).to_have_count(4, timeout=CALL_S)


def use_tool(chat: ChatPage, name: str) -> None:
    """Switch `name` on in this chat and make the next question's first reply call it."""
    open_tools(chat)
    chat.page.locator(f"[data-testid=tool-toggle][value='{name}']").check()
    chat.page.get_by_test_id("tool-choice").select_option(name)


def ask_for_call(chat: ChatPage, text: str) -> Any:
    """Ask; the reply is a call, shown as a card: the card's locator once it waits for the user."""
    before = len(chat.page.get_by_test_id("tool-call").all())
    chat.send(text)
    card = chat.page.get_by_test_id("tool-call").nth(before)
    expect(card).to_have_attribute("data-status", "pending", timeout=CALL_S)
    return card


def generates(chat: ChatPage) -> list[dict[str, Any]]:
    return [f for f in chat.sent if f.get("type") == "generate"]


def wait_idle(chat: ChatPage) -> None:
    """The loop has ended: the last reply is done and nothing runs (Send is back)."""
    expect(chat.page.get_by_test_id("send")).to_be_visible(timeout=CALL_S)
    chat.wait_done(timeout_ms=CALL_S)


def test_the_page_lists_the_servers_and_their_tools(tools_chat: ChatPage) -> None:
    page = tools_chat.page
    expect(page.get_by_test_id("tools-open")).to_be_visible()
    open_tools(tools_chat)
    names = [t.get_attribute("value") for t in page.get_by_test_id("tool-toggle").all()]
    assert {"local__now", "local__weather", "local__slow", "local__crash", "local__huge", "local__html", "web__now",
            "time__get_current_time", "time__convert_time"} <= set(names)
    expect(page.get_by_test_id("tools-summary")).to_contain_text("No tool is switched on")
    page.locator("[data-testid=tool-toggle][value='local__weather']").check()
    expect(page.get_by_test_id("tools-summary")).to_contain_text(re_text(r"1 tool on · about \d+ tokens of the "
                                                                         r"model's 8192-token context"))
    expect(page.get_by_test_id("tools-open")).to_have_text("Tools · 1")
    tools_chat.send("Hello")  # no choice forced: the model may answer in words; the tool is offered
    wait_idle(tools_chat)
    assert generates(tools_chat)[-1]["tools"] == ["local__weather"]
    assert "tool_choice" not in generates(tools_chat)[-1]


def re_text(pattern: str) -> Any:
    import re

    return re.compile(pattern)


def test_a_forced_call_shows_its_heatmap_and_allow_runs_it(tools_chat: ChatPage, artifacts: Path) -> None:
    page = tools_chat.page
    use_tool(tools_chat, "local__weather")
    card = ask_for_call(tools_chat, "What is the weather like?")
    sent = generates(tools_chat)[-1]
    assert sent["tools"] == ["local__weather"]
    assert sent["tool_choice"] == {"type": "function", "function": {"name": "local__weather"}}
    expect(card.get_by_test_id("tool-call-name")).to_have_text("weather")
    tokens = card.get_by_test_id("token")
    text = "".join(tokens.all_text_contents())
    assert "local__weather" in text and any(city in text for city in ("Paris", "Oslo", "Lima"))
    ps = [float(p or "nan") for p in tokens.evaluate_all("ts => ts.map(t => t.dataset.p)")]
    assert len(ps) > 5 and all(0 <= p <= 1 for p in ps)
    backgrounds = tokens.evaluate_all("ts => ts.map(t => getComputedStyle(t).backgroundColor)")
    assert all(b.startswith("rgb(") for b in backgrounds), backgrounds  # coloured with the heatmap switched off
    texts = [t or "" for t in tokens.all_text_contents()]
    at = min(text.find(c) for c in ("Paris", "Oslo", "Lima") if c in text)
    first = next(i for i in range(len(texts)) if len("".join(texts[: i + 1])) > at)  # the token the city starts in
    tokens.nth(first).hover()
    expect(page.get_by_test_id("popover")).to_be_visible()  # its alternatives: how sure the model was
    page.get_by_test_id("tools-open").click()  # the panel closed: the card in full view
    card.scroll_into_view_if_needed()
    card.screenshot(path=str(artifacts / "tool-card.png"))
    page.screenshot(path=str(artifacts / "tool-card-page.png"))
    card.get_by_test_id("tool-allow").click()
    result = page.get_by_test_id("tool-message").last
    expect(result).to_contain_text(re_text(r"(Paris|Oslo|Lima): sunny, 21 °C"), timeout=CALL_S)
    wait_idle(tools_chat)
    expect(card).to_have_attribute("data-status", "done")
    [call_frame] = [f for f in tools_chat.sent if f.get("type") == "call_tool"]
    assert call_frame["name"] == "local__weather" and json.loads(call_frame["arguments"])["city"] in text
    after = generates(tools_chat)[-1]  # the model goes on with the result
    assert after["messages"][-1]["role"] == "tool" and "sunny" in after["messages"][-1]["content"]
    call = after["messages"][-2]["tool_calls"][0]
    assert after["messages"][-1]["tool_call_id"] == call["id"] and call["function"]["name"] == "local__weather"
    assert "<tool_call>" not in after["messages"][-2]["content"]  # the call goes as tool_calls, not as text
    assert "tool_choice" not in after  # only the first reply to a question is forced
    tools_chat.reload()  # kept with the conversation
    tools_chat.wait_connected()
    expect(page.get_by_test_id("tool-call")).to_have_attribute("data-status", "done")
    expect(page.get_by_test_id("tool-message")).to_contain_text("sunny")


def test_deny_tells_the_model_and_runs_nothing(tools_chat: ChatPage) -> None:
    tools_chat.set_settings(tool_rounds="1")  # one round of calls a question: then the model answers in words
    use_tool(tools_chat, "local__now")
    card = ask_for_call(tools_chat, "What time is it?")
    card.get_by_test_id("tool-deny").click()
    wait_idle(tools_chat)
    expect(card).to_have_attribute("data-status", "denied")
    after = generates(tools_chat)[-1]
    assert after["messages"][-1]["role"] == "tool" and after["messages"][-1]["content"] == DENIED
    assert after["tools"] == ["local__now"] and after["tool_choice"] == "none"  # the round used up
    assert [f for f in tools_chat.sent if f.get("type") == "call_tool"] == []


def test_http_server_and_allow_in_this_chat(tools_chat: ChatPage) -> None:
    page = tools_chat.page
    use_tool(tools_chat, "web__now")
    card = ask_for_call(tools_chat, "What time is it over HTTP?")
    card.get_by_test_id("tool-allow-always").click()
    expect(page.get_by_test_id("tool-message").last).to_contain_text("2026-11-30T12:00:00+00:00", timeout=CALL_S)
    wait_idle(tools_chat)
    tools_chat.send("And now?")  # allowed in this chat: the next call runs without asking
    expect(page.get_by_test_id("tool-message")).to_have_count(2, timeout=CALL_S)
    wait_idle(tools_chat)
    assert [f["name"] for f in tools_chat.sent if f.get("type") == "call_tool"] == ["web__now", "web__now"]
    expect(page.get_by_test_id("tool-ask-again")).to_have_count(1)


def test_the_published_time_server(tools_chat: ChatPage, e2e_tiny_model_dir: Path) -> None:
    from tokenizers import Tokenizer

    quote = Tokenizer.from_file(str(e2e_tiny_model_dir / "tokenizer.json")).token_to_id('"')
    tools_chat.set_settings(token_bias=f"{quote}: 100")  # the random model closes its strings at once
    use_tool(tools_chat, "time__get_current_time")
    card = ask_for_call(tools_chat, "What time is it in UTC?")
    card.get_by_test_id("tool-allow").click()
    result = tools_chat.page.get_by_test_id("tool-message").last
    expect(result).to_contain_text("timezone", timeout=CALL_S)  # mcp-server-time's own answer
    wait_idle(tools_chat)
    assert generates(tools_chat)[-1]["messages"][-1]["role"] == "tool"


def test_each_limit_is_that_calls_outcome_shown_as_text(tools_chat: ChatPage) -> None:
    page = tools_chat.page
    title = page.title()
    expected = {"strict__slow": "within 3 s", "local__crash": "closed the connection",
                "local__huge": "[truncated: the result was 10,000,000 characters",
                "local__html": '<script>document.title = "pwned"</script>'}
    for i, (tool, words) in enumerate(expected.items()):
        use_tool(tools_chat, tool)
        card = ask_for_call(tools_chat, f"Use {tool}")
        card.get_by_test_id("tool-allow").click()
        result = page.get_by_test_id("tool-message").nth(i)
        expect(result).to_contain_text(words, timeout=CALL_S)
        wait_idle(tools_chat)
    statuses = page.get_by_test_id("tool-call").evaluate_all("cs => cs.map(c => c.dataset.status)")
    assert statuses == ["error", "error", "done", "done"]
    assert page.locator("#messages script, #messages img, #messages b").count() == 0  # HTML stayed text
    assert page.title() == title
    huge = page.get_by_test_id("tool-result-text").nth(2).text_content() or ""
    assert 16_000 <= len(huge) < 16_200


def test_stop_ends_a_running_call(tools_chat: ChatPage) -> None:
    page = tools_chat.page
    use_tool(tools_chat, "web__slow")
    card = ask_for_call(tools_chat, "Take your time")
    card.get_by_test_id("tool-allow").click()
    expect(card).to_have_attribute("data-status", "running")
    expect(page.get_by_test_id("send")).to_be_hidden()
    n = len(generates(tools_chat))
    page.get_by_test_id("stop").click()
    expect(card).to_have_attribute("data-status", "cancelled", timeout=10_000)
    expect(page.get_by_test_id("send")).to_be_visible()
    results = [f for f in tools_chat.frames if f.get("type") == "tool_result"]
    assert results[-1]["error"] == "cancelled"
    assert len(generates(tools_chat)) == n  # the loop ended: the model was not asked again
    tools_chat.send("Never mind")
    wait_idle(tools_chat)
    assert all("tool_calls" not in m for m in generates(tools_chat)[-1]["messages"])  # a call never told is not sent


def test_export_and_import_keep_the_calls(tools_chat: ChatPage, new_page: Callable[..., ChatPage],
                                          tools_server: Server, tmp_path: Path) -> None:  # fmt: skip
    use_tool(tools_chat, "local__now")
    card = ask_for_call(tools_chat, "Time, please")
    card.get_by_test_id("tool-allow").click()
    wait_idle(tools_chat)
    with tools_chat.page.expect_download() as info:
        tools_chat.page.get_by_test_id("export-all").click()
    path = tmp_path / "export.json"
    info.value.save_as(path)
    doc = json.loads(path.read_text())
    assert doc["version"] == 4  # version 4 added images; the tool fields are as version 3 had them
    [conv] = doc["conversations"]
    assert conv["tools"] == ["local__now"]
    other = new_page(tools_server)
    other.page.get_by_test_id("import-file").set_input_files(str(path))
    expect(other.page.get_by_test_id("import-status")).to_have_text("Imported 1 conversation")
    other.page.get_by_test_id("conversation-list").get_by_text("Time, please").click()
    expect(other.page.get_by_test_id("tool-call")).to_have_attribute("data-status", "done")
    expect(other.page.get_by_test_id("tool-message")).to_contain_text("2026-11-30T12:00:00+00:00")


def test_axe_finds_no_serious_violations_in_the_tools(tools_server: Server,
                                                      new_page: Callable[..., ChatPage]) -> None:
    from test_actions_a11y import run_axe

    chat = new_page(tools_server, bypass_csp=True)  # bypass_csp: only to inject axe.min.js
    chat.set_settings(max_new_tokens=REPLY_TOKENS)
    use_tool(chat, "local__weather")
    ask_for_call(chat, "Weather?")
    assert run_axe(chat.page) == [], "the tools panel and a call waiting"


CALL = {"id": "call_1", "name": "local__now", "arguments": "{}", "status": "done", "span": [0, 2]}


@pytest.mark.parametrize(("reply", "result", "field"), [
    ({"toolCalls": [{**CALL, "status": "hacked"}]}, {}, "toolCalls[0].status"),
    ({"toolCalls": [{**CALL, "span": [0, 99]}]}, {}, "toolCalls[0].span"),
    ({"toolCalls": [CALL]}, {"toolCallId": None}, "toolCallId"),
])
def test_a_crafted_tool_field_is_refused_by_name(tools_server: Server, new_page: Callable[..., ChatPage],
                                                 tmp_path: Path, reply: dict[str, Any], result: dict[str, Any],
                                                 field: str) -> None:  # fmt: skip
    msgs = [{"role": "user", "content": "time?"}, {"role": "assistant", "content": "{}", **reply},
            {"role": "tool", "content": "noon", "toolCallId": "call_1", **result}]
    thread = None
    for msg in reversed(msgs):
        thread = {"versions": [{"msg": msg, "next": thread}], "current": 0}
    conv = {"id": "x", "title": "crafted", "created": 1, "updated": 2, "root": thread}
    path = tmp_path / "crafted.json"
    path.write_text(json.dumps({"format": "webchat-conversations", "version": 3, "conversations": [conv]}))
    chat = new_page(tools_server)
    chat.page.get_by_test_id("import-file").set_input_files(str(path))
    status = chat.page.get_by_test_id("import-status")
    expect(status).to_contain_text(field)
    expect(status).to_contain_text("nothing was imported")
