"""A remote engine's thinking in the same fold (webchat.serve.remote.thinking): the upstream's reasoning_content /
reasoning mapped to token parts, markers out of the text; the kwargs and budget sent in each engine's fields; a
branch continued as text from inside thinking split here. The chunks are written from the engines' documented
shapes (vLLM's DeltaMessage.reasoning, llama-server's reasoning_content), not recorded; the last test runs a real
webchat front on a webchat upstream."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from test_remote_live import front  # tests/ is on sys.path under pytest
from test_thinking_api import ASK, forced, live, qwen3, qwen3_config, whole  # noqa: F401 (fixtures)

from webchat.engine import events as ev
from webchat.serve.remote.parse import StreamParser
from webchat.serve.remote.thinking import text_split, thinking_fields
from webchat.serve.runtime import Runtime
from webchat.serve.thinking import Ask

pytestmark = pytest.mark.timeout(300)


def entry(token: str, p: float = 0.5) -> dict[str, Any]:
    return {"token": token, "logprob": math.log(p), "bytes": list(token.encode()),
            "top_logprobs": [{"token": token, "logprob": math.log(p), "bytes": list(token.encode())}]}


def chunk(delta: dict[str, Any], tokens: list[str] | None = None, **logprobs: Any) -> dict[str, Any]:
    choice: dict[str, Any] = {"index": 0, "delta": delta, "finish_reason": None}
    if tokens is not None or logprobs:
        choice["logprobs"] = {"content": [entry(t) for t in tokens or []], **logprobs}
    return {"choices": [choice]}


def parts(tokens: list[ev.TokenInfo], part: str) -> str:
    return "".join(t.piece for t in tokens if t.part == part)


def run(chunks: list[dict[str, Any]]) -> list[ev.TokenInfo]:
    parser = StreamParser()
    return [t for c in chunks for t in parser.feed(c).tokens]


@pytest.mark.parametrize("name", ["reasoning", "reasoning_content"])
def test_vllm_and_llama_server_thinking_labels_the_tokens_and_leaves_the_markers_out(name: str) -> None:
    """vLLM (`reasoning`) and llama-server (`reasoning_content`) leave the markers out of the delta's text but not
    out of the logprobs: their tokens keep the text as `raw`, as does the whitespace after `</think>`."""
    tokens = run([chunk({"role": "assistant"}, ["<think>"]), chunk({name: "Let"}, ["Let"]),
                  chunk({name: " me"}, [" me"]), chunk({}, ["</think>"]), chunk({"content": "\n\nFour"}, ["\n\nFour"]),
                  chunk({"content": "."}, ["."])])
    assert (parts(tokens, "thinking"), parts(tokens, "answer")) == ("Let me", "Four.")
    assert [t.raw for t in tokens] == ["<think>", None, None, "</think>", "\n\nFour", None]
    assert [t.part for t in tokens[:3]] == ["thinking"] * 3


def test_several_tokens_in_one_chunk_are_labelled_by_how_much_thinking_the_delta_holds() -> None:
    tokens = run([chunk({"reasoning_content": "ab"}, ["<think>", "a", "b"]),
                  chunk({"reasoning_content": "c", "content": "Yes"}, ["c", "</think>", "Yes"])])
    assert [(t.piece, t.part) for t in tokens] == [("", "thinking"), ("a", "thinking"), ("b", "thinking"),
                                                   ("c", "thinking"), ("", "answer"), ("Yes", "answer")]


def test_a_webchat_upstream_sends_its_thinking_tokens_apart() -> None:
    thought = [entry("<think>"), entry("\n"), entry("Hm")]
    tokens = run([chunk({"reasoning_content": "Hm", "reasoning": "Hm"}, [], reasoning_content=thought),
                  chunk({"content": "Ok"}, ["Ok"])])
    assert [(t.piece, t.part, t.raw) for t in tokens] == [("", "thinking", "<think>"), ("", "thinking", "\n"),
                                                          ("Hm", "thinking", None), ("Ok", "answer", None)]


def test_without_logprobs_the_thinking_and_the_answer_come_as_a_token_each() -> None:
    parser = StreamParser()
    out = parser.feed(chunk({"reasoning_content": "Hmm", "content": "Yes"}))
    assert [(t.piece, t.part, t.prob) for t in out.tokens] == [("Hmm", "thinking", None), ("Yes", "answer", None)]
    assert ev.Tokens(out.text, out.tokens).thinking == "Hmm" and ev.Tokens(out.text, out.tokens).answer == "Yes"
    plain = StreamParser().feed(chunk({"content": "<think>x"}, ["<think>", "x"]))  # no thinking field: text as sent
    assert plain.text == "<think>x" and {t.part for t in plain.tokens} == {"answer"}


def test_the_kwargs_and_the_budget_go_in_each_engines_fields() -> None:
    ask = Ask(kwargs={"enable_thinking": False}, budget=64, message="Enough.")
    assert thinking_fields("vllm", ask) == {"chat_template_kwargs": {"enable_thinking": False},
                                            "thinking_token_budget": 64}
    assert thinking_fields("llama.cpp", ask) == {"chat_template_kwargs": {"enable_thinking": False},
                                                 "reasoning_budget_tokens": 64, "reasoning_budget_message": "Enough."}
    assert thinking_fields("sglang", ask) == {"chat_template_kwargs": {"enable_thinking": False}}
    assert thinking_fields("openai-compatible", ask) == {} and thinking_fields("vllm", None) == {}


def test_a_branch_continued_as_text_from_inside_thinking_is_split_here() -> None:
    split = text_split([{"role": "user", "content": "Q"}, {"role": "assistant", "content": "<think>\nSo"}], True)
    assert split is not None
    toks = [ev.TokenInfo(id=i, piece=p) for i, p in enumerate([" then", "</th", "ink>", "\n\nYes"])]
    out = split.push(toks[:2]) + split.push(toks[2:]) + split.flush()
    assert [(t.piece, t.part) for t in out] == [(" then", "thinking"), ("", "thinking"), ("", "thinking"),
                                                ("Yes", "answer")]
    assert text_split([{"role": "assistant", "content": "<think>a</think>b"}], True) is None
    assert text_split([{"role": "assistant", "content": "<think>a"}], False) is None  # a chat stream says itself


@pytest.fixture(scope="module")
def remote_front(live: Any) -> Iterator[str]:  # noqa: F811 (the upstream: the tiny Qwen3's webchat)
    with front(live.url) as url:
        yield url


def test_a_webchat_front_on_a_thinking_upstream_gives_the_same_parts(remote_front: str, live: Any,  # noqa: F811
                                                                     qwen3: Runtime) -> None:  # noqa: F811
    """The front sends the budget on, the upstream thinks; the front's API and websocket say it as the upstream
    does (the same greedy reply); hello.thinking is the upstream's."""
    body = forced(qwen3, max_tokens=16, reasoning_budget_tokens=4, logprobs=True, top_logprobs=1)
    direct = whole(live.url, body)["choices"][0]
    via = whole(remote_front, body)["choices"][0]
    assert via["message"] == direct["message"]
    assert [e["token"] for e in via["logprobs"]["reasoning_content"]] == \
        [e["token"] for e in direct["logprobs"]["reasoning_content"]]
    think = str(qwen3.local()[1].encode("<think>")[0])
    frame = {"type": "generate", "id": "r", "messages": ASK, "max_new_tokens": 16, "alternatives": 1,
             "reasoning_budget": 4, "settings": {"temperature": 0.0, "token_bias": {think: 20},
                                                 "repetition_penalty": 10, "presence_penalty": 2,
                                                 "frequency_penalty": 2}}
    from websockets.sync.client import connect

    thinking, text = "", ""
    with connect(remote_front.replace("http", "ws") + "/ws") as ws:
        json.loads(ws.recv(10))
        ws.send(json.dumps(frame))
        while (msg := json.loads(ws.recv(60)))["type"] != "done":
            assert msg["type"] != "error", msg
            if msg["type"] == "chunk":
                thinking += msg.get("thinking", "")
                text += msg["text"]
    assert (thinking, text) == (direct["message"]["reasoning_content"], direct["message"]["content"])
    info = httpx.get(f"{remote_front}/api/info").json()  # the page's Think switch follows the upstream's model
    assert info["thinking"] == info["engine"]["thinking"] == {"start": "<think>", "end": "</think>", "switch": True}
