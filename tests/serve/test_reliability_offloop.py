"""Issue 63, rows 5, 6, 9, 16 and 17: grammar and prompt work runs off the event loop (a compile that takes a second
holds no other client), a grammar past its budget ends its own request alone, the thinking splitter is linear, and a
broken link in the models folder is named in the log."""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import llguidance as llg
import pytest
from live_server import Live, serve  # tests/ is on sys.path under pytest

from webchat.engine.constraint import ConstraintError, empty_mask
from webchat.grammar import build, matcher
from webchat.serve import requests
from webchat.serve.catalog import scan
from webchat.serve.config import ServerConfig
from webchat.serve.runtime import Runtime, load_runtime
from webchat.text.thinking_split import Markers, PartSplitter
from webchat.text.tokenizer import Tokenizer

pytestmark = pytest.mark.timeout(300)
HI = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def config(tiny_model_dir: Path) -> ServerConfig:
    return ServerConfig(model_dir=tiny_model_dir, device="cpu", max_sessions=4, max_queue=8)


@pytest.fixture(scope="module")
def live(config: ServerConfig) -> Iterator[Live]:
    runtime: Runtime = load_runtime(config)
    with serve(config, runtime) as server:
        yield server


def model(live: Live) -> str:
    name: str = httpx.get(f"{live.url}/v1/models").json()["data"][0]["id"]
    return name


def post_chat(live: Live, out: list[httpx.Response], **fields: Any) -> threading.Thread:
    def send() -> None:
        out.append(httpx.post(f"{live.url}/v1/chat/completions", timeout=120,
                              json={"model": model(live), "messages": HI, "max_tokens": 4, **fields}))

    thread = threading.Thread(target=send)
    thread.start()
    return thread


def test_a_compiling_grammar_holds_no_other_client(live: Live, monkeypatch: pytest.MonkeyPatch) -> None:
    """Row 5: the compile of a request's grammar is held (as a 6,000-property schema holds it for a second); the
    server answers /healthz and another client's reply meanwhile, and the compile ran on a compiler thread."""
    held, release, threads = threading.Event(), threading.Event(), []
    check = matcher.Grammars.check

    def slow_check(self: matcher.Grammars, grammar: str) -> None:
        threads.append(threading.current_thread().name)
        held.set()
        release.wait(60)
        check(self, grammar)

    monkeypatch.setattr(matcher.Grammars, "check", slow_check)
    out: list[httpx.Response] = []
    sender = post_chat(live, out, response_format={"type": "json_object"})
    try:
        assert held.wait(30)
        assert httpx.get(f"{live.url}/healthz", timeout=5).status_code == 200
        other = httpx.post(f"{live.url}/v1/chat/completions", timeout=30,
                           json={"model": model(live), "messages": HI, "max_tokens": 3, "temperature": 0.0})
        assert other.status_code == 200 and other.json()["choices"][0]["message"]["content"] is not None
        assert not out  # the held request is still compiling
    finally:
        release.set()
        sender.join(60)
    assert out[0].status_code == 200, out[0].text
    assert threads and all(name.startswith("webchat-grammar-") for name in threads), threads


def test_tools_are_planned_and_templated_off_the_event_loop(live: Live, monkeypatch: pytest.MonkeyPatch) -> None:
    """Row 9: 128 tools of 60 required parameters: their schemas are checked on a compiler thread and the prompt is
    rendered on an encode thread (the prompt is then too long for the context: a 400 saying so)."""
    where: dict[str, str] = {}
    plan, render = requests.chat_tools, requests.LocalPreparer._encode

    def planned(*args: Any) -> Any:
        where["plan"] = threading.current_thread().name
        return plan(*args)

    def rendered(self: requests.LocalPreparer, *args: Any, **kwargs: Any) -> Any:
        where["render"] = threading.current_thread().name
        return render(self, *args, **kwargs)

    monkeypatch.setattr(requests, "chat_tools", planned)
    monkeypatch.setattr(requests.LocalPreparer, "_encode", rendered)
    params = {"type": "object", "properties": {f"a{j}": {"type": "string"} for j in range(60)},
              "required": [f"a{j}" for j in range(60)]}
    tools = [{"type": "function", "function": {"name": f"t{i}", "parameters": params}} for i in range(128)]
    out: list[httpx.Response] = []
    post_chat(live, out, tools=tools).join(120)
    assert out[0].status_code == 400 and out[0].json()["error"]["code"] == "context_length_exceeded", out[0].text
    assert where["plan"].startswith("webchat-grammar-"), where
    assert where["render"].startswith("webchat-encode"), where


def test_a_grammar_past_its_budget_ends_its_own_request(live: Live, monkeypatch: pytest.MonkeyPatch) -> None:
    """Row 6: every matcher call has a CPU budget; a grammar over it ends its request with the `grammar` error (a 400
    before any output), and a request beside it is served."""
    monkeypatch.setattr(matcher, "MASK_BUDGET_S", 1e-9)  # every call overruns
    out: list[httpx.Response] = []
    post_chat(live, out, structured_outputs={"regex": "[a-z]{1,30}"}).join(60)
    assert out[0].status_code == 400, out[0].text
    error = out[0].json()["error"]
    assert error["code"] == "grammar" and "the grammar is too slow" in error["message"]
    assert "ms one step allows" in error["message"]
    monkeypatch.undo()
    ok = httpx.post(f"{live.url}/v1/chat/completions", timeout=30,
                    json={"model": model(live), "messages": HI, "max_tokens": 3})
    assert ok.status_code == 200


def test_the_budget_is_cpu_time_of_each_call(tiny_model_dir: Path) -> None:
    tok = Tokenizer.from_dir(tiny_model_dir)
    grammars = matcher.grammars_for(tok, 512)
    constraint = matcher.GrammarConstraint(llg.LLMatcher(grammars.tokenizer(), build.regex("[a-z]{1,30}"),
                                                         log_level=0, limits=build.LIMITS), "g", budget_s=1e-9)
    with pytest.raises(ConstraintError, match=r"computing the tokens allowed next took \d+ ms of CPU time"):
        constraint.mask(empty_mask(512))
    roomy = grammars.constraint(build.regex("[a-z]{1,30}"))
    assert roomy.budget_s == matcher.MASK_BUDGET_S and roomy.mask(empty_mask(512))


def test_the_thinking_splitter_holds_leading_whitespace_in_constant_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """Row 16: n whitespace tokens at a reply's start each re-joined all held text (32,000 tokens: 37 s)."""
    reads = 0
    at_start = PartSplitter._at_start

    def counted(self: PartSplitter[int], text: str) -> Any:
        nonlocal reads
        reads += 1
        return at_start(self, text)

    monkeypatch.setattr(PartSplitter, "_at_start", counted)
    splitter: PartSplitter[int] = PartSplitter(Markers())
    for i in range(5000):
        assert splitter.push(i, " \n"[i % 2]) == []
    released = splitter.push(5000, "Hello")
    assert reads == 1 and len(released) == 5001 and released[-1] == (5000, "Hello", "answer")
    splitter = PartSplitter(Markers())  # whitespace then the start marker: thinking, the whitespace left out
    out = [*splitter.push(0, "  "), *splitter.push(1, "\n"), *splitter.push(2, "<think>"), *splitter.push(3, "hm")]
    assert [(piece, part) for _, piece, part in out] == [("", "thinking")] * 3 + [("hm", "thinking")]


def test_a_broken_link_in_the_models_folder_is_named_in_the_log(tiny_model_dir: Path, tmp_path: Path,
                                                               caplog: pytest.LogCaptureFixture) -> None:
    """Row 17: a link loop (or a link to nothing) without a .gguf name was left out silently."""
    os.symlink(tmp_path / "loop", tmp_path / "loop")
    os.symlink(tmp_path / "nothing", tmp_path / "dangling")
    with caplog.at_level(logging.WARNING):
        cards = scan(tiny_model_dir, tmp_path)
    assert list(cards) == [next(iter(cards))]
    lines = [r.getMessage() for r in caplog.records]
    assert f"models dir: {tmp_path / 'loop'} left out: a symbolic link loop" in lines
    assert f"models dir: {tmp_path / 'dangling'} left out: a symbolic link to nothing" in lines


def test_a_long_scored_prompt_is_formatted_off_the_event_loop(live: Live, monkeypatch: pytest.MonkeyPatch) -> None:
    """Row 7: 8,000 scored tokens with 20 alternatives each are 11 MB of JSON, most of a second of the loop's time;
    past OFFLOAD_TOKENS the scores are formatted and rendered on an encode thread (the API's and the websocket's)."""
    from webchat.serve.openai.format import Reply
    from webchat.serve.scoring import ScoreReply

    where: list[str] = []
    prompt, messages = Reply.prompt, ScoreReply.messages

    def formatted(self: Reply, event: Any) -> Any:
        where.append(threading.current_thread().name)
        return prompt(self, event)

    def scored(self: ScoreReply, event: Any) -> Any:
        if self.tokens is not None:
            where.append(threading.current_thread().name)
        return messages(self, event)

    monkeypatch.setattr(Reply, "prompt", formatted)
    monkeypatch.setattr(ScoreReply, "messages", scored)
    text = "the quick brown fox " * 200  # ~800 tokens of the tiny model: past OFFLOAD_TOKENS
    r = httpx.post(f"{live.url}/v1/completions", timeout=120,
                   json={"model": model(live), "prompt": text, "max_tokens": 0, "echo": True, "logprobs": 3})
    assert r.status_code == 200 and len(r.json()["choices"][0]["logprobs"]["tokens"]) > 512
    from websockets.sync.client import connect

    with connect(live.ws_url) as ws:
        ws.recv(10)
        ws.send(json.dumps({"type": "score", "id": "s", "text": text, "alternatives": 3}))
        while (msg := json.loads(ws.recv(120)))["type"] not in ("scored", "error"):
            pass
    assert msg["type"] == "scored" and len(msg["tokens"]) > 512
    assert where and all(name.startswith("webchat-encode") for name in where), where


def test_a_long_text_is_tokenized_with_the_gil_released(real_model_dir: Path) -> None:
    """tokenizers' `encode` holds the GIL (0.6 s for 728 KB of tool schemas, the event loop stopped meanwhile): a
    long text goes through `encode_batch`, which lets other threads run, with the same ids."""
    tok = Tokenizer.from_dir(real_model_dir)
    text = '{"type": "function", "function": {"name": "t1", "parameters": {"a1": {"type": "string"}}}} ' * 4000
    ticks, done = [0], threading.Event()

    def tick() -> None:
        while not done.is_set():
            ticks[0] += 1
            done.wait(0.001)

    other = threading.Thread(target=tick)
    other.start()
    try:
        ids = tok.encode(text)
        during = ticks[0]
    finally:
        done.set()
        other.join()
    assert ids == tok._tok.encode(text, add_special_tokens=False).ids  # the same ids as the GIL-holding call
    assert during >= 20, f"another thread ran {during} times while 364 KB were tokenized"


def test_the_grammar_table_is_built_at_load_not_on_the_first_request(config: ServerConfig) -> None:
    """Building the tokenizer's table for grammars holds the GIL ~0.4 s: warm_up builds it, so the first structured
    request pauses nobody."""
    from webchat.serve.runtime import warm_up

    runtime = warm_up(load_runtime(config))
    _, tokenizer, _ = runtime.local()
    grammars = matcher.grammars_for(tokenizer, runtime.model.args.vocab_size)
    assert tuple(tokenizer.stop_token_ids) in grammars._tokenizers
