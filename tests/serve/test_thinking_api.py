"""Thinking on the wire (issue 40): a tiny random Qwen3 with Qwen3's real template, and the tiny ChatML model
continued from `<think>`, served by a real uvicorn; read by the official `openai` client, raw SSE and the websocket.

A reply is forced to think by a logit bias on `<think>` (the tiny Qwen3's head gives it logit 0, so it never comes
by itself) with penalties that keep it from coming twice: the first token opens thinking, the model goes on as it
would, and a reasoning budget closes it."""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from live_server import Live, serve  # tests/ is on sys.path under pytest
from websockets.sync.client import connect as sync_connect

from bench.tiny import make_tiny_qwen3
from webchat.serve.config import ServerConfig
from webchat.serve.runtime import Runtime, load_runtime
from webchat.serve.thinking import encode_tail
from webchat.text.detok import decode_all

pytestmark = pytest.mark.timeout(300)
QWEN3 = (Path(__file__).parents[1] / "fixtures" / "templates" / "Qwen-Qwen3-0.6B.jinja").read_text()
ASK = [{"role": "user", "content": "What is two plus two?"}]
OPENED = [*ASK, {"role": "assistant", "content": "<think>\n"}]
CONTINUE = {"continue_final_message": True, "add_generation_prompt": False}


@pytest.fixture(scope="module")
def qwen3_config(tmp_path_factory: pytest.TempPathFactory) -> ServerConfig:
    folder = make_tiny_qwen3(tmp_path_factory.mktemp("tiny-qwen3"), QWEN3)
    return ServerConfig(model_dir=folder, device="cpu", max_seq_len=256, stream_interval=0)


@pytest.fixture(scope="module")
def qwen3(qwen3_config: ServerConfig) -> Runtime:
    return load_runtime(qwen3_config)


@pytest.fixture(scope="module")
def live(qwen3_config: ServerConfig, qwen3: Runtime) -> Iterator[Live]:
    with serve(qwen3_config, qwen3) as server:
        yield server


@pytest.fixture(scope="module")
def chatml_config(tiny_model_dir: Path) -> ServerConfig:
    return ServerConfig(model_dir=tiny_model_dir, device="cpu", max_seq_len=256, stream_interval=0)


@pytest.fixture(scope="module")
def chatml(chatml_config: ServerConfig) -> Runtime:
    return load_runtime(chatml_config)


@pytest.fixture(scope="module")
def live_chatml(chatml_config: ServerConfig, chatml: Runtime) -> Iterator[Live]:
    """Each step slowed a little, so that each step's tokens are a chunk of their own."""
    with serve(chatml_config, chatml, delay=0.03) as server:
        yield server


def forced(rt: Runtime, **extra: Any) -> dict[str, Any]:
    think = rt.local()[1].encode("<think>")[0]
    return {"model": rt.model_name, "messages": ASK, "temperature": 0, "logit_bias": {str(think): 20},
            "repetition_penalty": 10, "presence_penalty": 2, "frequency_penalty": 2, **extra}


def sse(url: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    with httpx.stream("POST", f"{url}/v1/chat/completions", json={**body, "stream": True}, timeout=120) as r:
        assert r.status_code == 200, r.read()
        return [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]


def whole(url: str, body: dict[str, Any]) -> dict[str, Any]:
    r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    result: dict[str, Any] = r.json()
    return result


def deltas(chunks: list[dict[str, Any]], name: str) -> list[str]:
    return [c["choices"][0]["delta"].get(name) or "" for c in chunks if c["choices"]]


def test_a_reply_forced_to_think_streams_its_thinking_as_reasoning_content(live: Live, qwen3: Runtime) -> None:
    """The openai client reads the thinking from a stream as `model_extra` (both names), the whole reply as
    message.reasoning_content, with logprobs for both parts; neither part holds a marker."""
    client = openai.OpenAI(base_url=f"{live.url}/v1", api_key="none", max_retries=0)
    body = forced(qwen3, max_tokens=24, reasoning_budget_tokens=6)
    extra = {k: body[k] for k in ("repetition_penalty", "reasoning_budget_tokens")}
    stream = client.chat.completions.create(model=body["model"], messages=ASK, stream=True, temperature=0,
                                            max_tokens=24, logit_bias=body["logit_bias"], presence_penalty=2,
                                            frequency_penalty=2, extra_body=extra)
    thought, said, names = "", "", set()
    for chunk in stream:
        delta = chunk.choices[0].delta if chunk.choices else None
        if delta is None:
            continue
        extras = delta.model_extra or {}
        names |= set(extras) & {"reasoning_content", "reasoning"}
        assert extras.get("reasoning_content") == extras.get("reasoning")
        thought += extras.get("reasoning_content") or ""
        said += delta.content or ""
    assert names == {"reasoning_content", "reasoning"}
    assert thought.strip() and said.strip()  # the budget closed the thinking; the answer followed
    reply = whole(live.url, {**body, "logprobs": True, "top_logprobs": 2})
    choice = reply["choices"][0]
    assert (choice["message"]["reasoning_content"], choice["message"]["content"]) == (thought, said)
    assert choice["message"]["reasoning"] == thought
    logprobs = choice["logprobs"]
    assert "".join(e["token"] for e in logprobs["content"]) == said
    assert "".join(e["token"] for e in logprobs["reasoning_content"]) == thought
    assert all(len(e["top_logprobs"]) == 2 for e in logprobs["content"] + logprobs["reasoning_content"])
    for text in (thought, said):
        assert "<think>" not in text and "</think>" not in text


def test_the_budget_closes_thinking_after_that_many_tokens_and_the_server_sets_the_default(
        qwen3_config: ServerConfig, qwen3: Runtime) -> None:
    """--reasoning-budget 3: three tokens after `<think>`, then the closing text as Qwen3's template writes it; a
    request's own budget wins, -1 none (the reply is then cut inside its thinking: all reasoning, no content)."""
    tok = qwen3.local()[1]
    close = encode_tail(tok, "\n</think>\n\n")
    config = replace(qwen3_config, reasoning_budget=3)
    with serve(config, load_runtime(config)) as server:  # an engine of its own: the module's server has one
        ids = whole(server.url, forced(qwen3, max_tokens=12, return_token_ids=True))["choices"][0]["token_ids"]
        assert ids[0] == tok.encode("<think>")[0] and ids[4:4 + len(close)] == close
        ids = whole(server.url, forced(qwen3, max_tokens=12, return_token_ids=True, thinking_token_budget=1))
        assert ids["choices"][0]["token_ids"][2:2 + len(close)] == close  # vLLM's name for the budget
        cut = whole(server.url, forced(qwen3, max_tokens=12, reasoning_budget_tokens=-1))["choices"][0]
    assert cut["finish_reason"] == "length" and cut["message"]["content"] == ""
    assert cut["message"]["reasoning_content"].strip()


def test_a_turn_continued_from_think_is_reasoning_streamed_and_whole(live_chatml: Live, chatml: Runtime) -> None:
    """Any model: an assistant turn continued from `<think>\\n` thinks; cut by max_tokens, it ends as thinking."""
    body = {"model": chatml.model_name, "messages": OPENED, "max_tokens": 10, "temperature": 0, **CONTINUE}
    choice = whole(live_chatml.url, body)["choices"][0]
    assert choice["message"]["content"] == "" and choice["message"]["reasoning_content"].strip()
    assert choice["finish_reason"] == "length"
    chunks = sse(live_chatml.url, body)
    assert "".join(deltas(chunks, "reasoning_content")) == choice["message"]["reasoning_content"]
    assert "".join(deltas(chunks, "content")) == ""


def test_a_closing_marker_split_across_two_chunks_leaks_into_neither(live_chatml: Live, chatml: Runtime) -> None:
    """The tiny ChatML vocabulary writes `</think>` as several tokens; a budget message long enough puts the
    marker across the forced tokens' two forwards (17 tokens a step: 16 fed, and the step's own), so its first
    tokens come in one step and its last in the next: the first step's chunk must hold them back, the second's
    take the whole marker out."""
    message = _message_across(chatml.local()[1])
    body = {"model": chatml.model_name, "messages": OPENED, "max_tokens": 40, "temperature": 0, "logprobs": True,
            "reasoning_budget_tokens": 1, "reasoning_budget_message": message, **CONTINUE}
    chunks = sse(live_chatml.url, body)
    entries = [c["choices"][0]["logprobs"] for c in chunks if c["choices"] and c["choices"][0]["logprobs"]]
    written = [bytes(b for e in lp.get("reasoning_content", []) + lp["content"] for b in e["bytes"]).decode(
        errors="replace") for lp in entries]
    # the step that wrote the marker's first tokens sent none of them: they waited for the next step's, which
    # completed it, and left with them (a chunk's tokens are those released, not those generated, in its step)
    marker = "</think>"
    assert not any(w.endswith(marker[:i]) for w in written for i in range(1, len(marker))), written
    assert any(w.startswith(marker) for w in written), written
    thought, said = deltas(chunks, "reasoning_content"), deltas(chunks, "content")
    reply = whole(live_chatml.url, body)["choices"][0]["message"]
    assert "".join(thought) == reply["reasoning_content"] and "".join(said) == reply["content"]
    assert reply["reasoning_content"].endswith(message + "\n")
    for piece in thought + said:
        assert not any(f in piece for f in ("</", "think>", "/th")), f"a piece of the marker leaked: {piece!r}"


def _message_across(tok: Any) -> str:
    """A budget message after which the 17-token boundary of the forced text falls inside `</think>`."""
    for n in range(1, 40):
        message = "so " * n
        ids = encode_tail(tok, message + "\n</think>\n\n")
        text = [tok.decode(ids[:i]) for i in range(len(ids) + 1)]
        at = next(i for i, t in enumerate(text) if "</" in t)
        end = next(i for i, t in enumerate(text) if "</think>" in t)
        if at <= 17 < end:
            return message
    raise AssertionError("no message puts the marker across the boundary")


def test_chat_template_kwargs_reach_the_template_and_bad_ones_are_named(live: Live, qwen3: Runtime) -> None:
    tok = qwen3.local()[1]
    r = httpx.post(f"{live.url}/tokenize", json={"messages": ASK, "chat_template_kwargs": {"enable_thinking": False}})
    assert tok.decode(r.json()["tokens"]).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    reply = whole(live.url, {"model": qwen3.model_name, "messages": ASK, "max_tokens": 3,
                             "chat_template_kwargs": {"enable_thinking": False, "unread_by_this_template": 1}})
    assert reply["usage"]["prompt_tokens"] == r.json()["count"]
    for bad, words in (({"messages": []}, "may not set 'messages'"), ({"not a name": 1}, "variable names")):
        err = httpx.post(f"{live.url}/v1/chat/completions", json={"model": qwen3.model_name, "messages": ASK,
                                                                  "chat_template_kwargs": bad})
        assert err.status_code == 400 and err.json()["error"]["param"] == "chat_template_kwargs"
        assert words in err.json()["error"]["message"]
    err = httpx.post(f"{live.url}/v1/chat/completions", json={"model": qwen3.model_name, "messages": ASK,
                                                              "reasoning_format": "parsed"})
    assert err.status_code == 400 and err.json()["error"]["param"] == "reasoning_format"


def test_earlier_thinking_is_left_out_of_the_prompt_as_qwen3s_template_does(live: Live, qwen3: Runtime) -> None:
    tok = qwen3.local()[1]
    chat = [ASK[0], {"role": "assistant", "content": "Four.", "reasoning_content": "SECRET"},
            {"role": "user", "content": "Thanks"}]
    text = tok.decode(httpx.post(f"{live.url}/tokenize", json={"messages": chat}).json()["tokens"])
    assert "Four." in text and "SECRET" not in text
    written = [ASK[0], {"role": "assistant", "content": "<think>\nSECRET\n</think>\n\nFour."}, chat[2]]
    assert tok.decode(httpx.post(f"{live.url}/tokenize", json={"messages": written}).json()["tokens"]) == text


def test_reasoning_format_none_keeps_the_reply_as_written(live: Live, qwen3: Runtime) -> None:
    message = whole(live.url, forced(qwen3, max_tokens=12, reasoning_budget_tokens=3,
                                     reasoning_format="none"))["choices"][0]["message"]
    assert message["content"].startswith("<think>") and "</think>" in message["content"]
    assert "reasoning_content" not in message


def websocket(url: str, frame: dict[str, Any]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """A generate's chunks and its done."""
    chunks = []
    with sync_connect(url.replace("http", "ws") + "/ws") as ws:
        hello = json.loads(ws.recv(10))
        ws.send(json.dumps({"type": "generate", "id": "t", "settings": {"temperature": 0.0}, "alternatives": 3,
                            **frame}))
        while (msg := json.loads(ws.recv(60)))["type"] not in ("done", "error"):
            if msg["type"] == "chunk":
                chunks.append(msg)
    assert msg["type"] == "done", msg
    return chunks, hello


def test_the_websocket_carries_each_tokens_part_and_a_branch_inside_thinking_goes_on_thinking(
        live: Live, qwen3: Runtime) -> None:
    tok = qwen3.local()[1]
    think = str(tok.encode("<think>")[0])
    settings = {"temperature": 0.0, "token_bias": {think: 20}, "repetition_penalty": 10, "presence_penalty": 2,
                "frequency_penalty": 2}
    chunks, hello = websocket(live.url, {"messages": ASK, "settings": settings, "max_new_tokens": 14,
                                         "reasoning_budget": 4})
    assert hello["thinking"] == {"start": "<think>", "end": "</think>", "switch": True}
    tokens = [t for c in chunks for t in c.get("tokens", [])]
    assert "".join(c.get("thinking", "") for c in chunks) == "".join(t["text"] for t in tokens
                                                                      if t.get("part") == "thinking")
    assert "".join(c["text"] for c in chunks) == "".join(t["text"] for t in tokens if "part" not in t)
    assert tokens[0] == {**tokens[0], "part": "thinking", "text": "", "raw": "<think>"}
    written = "".join(t.get("raw", t["text"]) for t in tokens)
    assert decode_all(tok.token_bytes, [t["id"] for t in tokens]) == written  # the raws spell what it wrote
    # a branch inside the thinking, with another alternative for a token: the rest is thinking again
    k = next(i for i, t in enumerate(tokens) if i >= 2 and t.get("part") == "thinking" and t["text"].isprintable()
             and t["text"].strip())
    alt = next(a for a in tokens[k]["top"] if a["id"] != tokens[k]["id"] and a["text"].isprintable())
    ids = [t["id"] for t in tokens[:k]] + [alt["id"]]
    prefix = decode_all(tok.token_bytes, ids)
    branch, _ = websocket(live.url, {"messages": [*ASK, {"role": "assistant", "content": prefix}], "continue": True,
                                     "prefix_ids": ids, "max_new_tokens": 3, "reasoning_budget": -1})
    parts = {t.get("part", "answer") for c in branch for t in c["tokens"]}
    assert parts == {"thinking"} and all(c["text"] == "" for c in branch)


def test_the_reasoning_budget_flag(monkeypatch: pytest.MonkeyPatch) -> None:
    from webchat.cli.serve import add_arguments, config_from_args

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert config_from_args(parser.parse_args([]), Path("m")).reasoning_budget is None
    assert config_from_args(parser.parse_args(["--reasoning-budget", "0"]), Path("m")).reasoning_budget == 0
    assert config_from_args(parser.parse_args(["--reasoning-budget", "-1"]), Path("m")).reasoning_budget is None
    with pytest.raises(SystemExit):
        parser.parse_args(["--reasoning-budget", "-2"])
    assert replace(ServerConfig(model_dir=Path("m")), reasoning_budget=5).reasoning_budget == 5


@pytest.mark.parametrize(("extra", "code", "words"), [
    ({"chat_template_kwargs": {"add_generation_prompt": False}}, "bad_message", "may not set 'add_generation_prompt'"),
    ({"chat_template_kwargs": ["enable_thinking"]}, "bad_message", "chat_template_kwargs"),
    ({"reasoning_budget": -2}, "bad_settings", "reasoning_budget = -2 is out of range"),
])
def test_the_websocket_names_a_bad_thinking_field(live: Live, extra: dict[str, Any], code: str, words: str) -> None:
    with sync_connect(live.ws_url) as ws:
        json.loads(ws.recv(10))
        ws.send(json.dumps({"type": "generate", "id": "bad", "messages": ASK, **extra}))
        msg = json.loads(ws.recv(30))
    assert (msg["type"], msg["id"], msg["code"]) == ("error", "bad", code) and words in msg["message"], msg
