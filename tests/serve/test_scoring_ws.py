"""`score` on the websocket (docs/protocol.md): a message scored in its chat, a pasted text alone, on the local engine
and through a remote engine (vLLM's prompt_logprobs upstream), and what an engine without prompt scores answers."""

from __future__ import annotations

import json
import re
import threading
import time
from typing import Any

import httpx
import pytest
import test_scoring_api
import torch
import uvicorn
from live_server import Live, free_port  # tests/ is on sys.path under pytest
from test_remote_live import fake_upstream_app, front
from websockets.sync.client import connect as sync_connect

from webchat.engine import events as ev
from webchat.serve import protocol as p
from webchat.serve.remote.client import UpstreamError
from webchat.serve.remote.scoring import parse_prompt_logprobs
from webchat.serve.runtime import Runtime
from webchat.serve.scoring import locate, target_tokens

pytestmark = pytest.mark.timeout(180)
runtime, live, reference = test_scoring_api.runtime, test_scoring_api.live, test_scoring_api.reference  # shared
CHAT = [{"role": "user", "content": "Tell me about the quick brown fox."}]


def ask(url: str, *frames: dict[str, Any]) -> list[dict[str, Any]]:
    """Send each frame in turn on one socket; every message until each one's scored/done/error."""
    out = []
    with sync_connect(url.replace("http", "ws") + "/ws") as ws:
        assert json.loads(ws.recv(10))["type"] == "hello"
        for frame in frames:
            ws.send(json.dumps(frame))
            while (msg := json.loads(ws.recv(60)))["type"] not in ("scored", "done", "error"):
                out.append(msg)
            out.append(msg)
    return out


def test_a_pasted_text_is_scored_alone(live: Live, runtime: Runtime) -> None:
    tok = runtime.local()[1]
    text = "The fox jumps over the dog, twice."
    msgs = ask(live.url, {"type": "score", "id": "s1", "text": text, "alternatives": 3})
    assert [m["type"] for m in msgs] == ["start", "scored"]
    scored = msgs[-1]
    ids = tok.encode_text(text)
    assert scored["model"] == runtime.model_name and [t["id"] for t in scored["tokens"]] == ids
    assert "".join(t["text"] for t in scored["tokens"]) == text
    assert scored["tokens"][0]["p"] is None and scored["tokens"][0]["rank"] is None  # nothing precedes it
    probs = reference(runtime, ids).exp()
    for i, t in enumerate(scored["tokens"][1:], start=1):
        assert t["p"] == pytest.approx(float(probs[i - 1, ids[i]]), abs=1e-5)
        assert [a["id"] for a in t["top"]] == torch.topk(probs[i - 1], 3).indices.tolist()
    assert scored["stats"]["prompt_tokens"] == len(ids) and scored["stats"]["new_tokens"] == 0


def test_a_message_is_scored_in_its_chat(live: Live, runtime: Runtime) -> None:
    """The user's message: its tokens only, each scored after the system prompt and template before it."""
    tok = runtime.local()[1]
    msgs = ask(live.url, {"type": "score", "id": "s2", "messages": CHAT, "alternatives": 2})
    tokens = msgs[-1]["tokens"]
    assert "".join(t["text"] for t in tokens) == CHAT[0]["content"]
    ids = tok.encode_chat(CHAT, add_generation_prompt=False)
    probs = reference(runtime, ids).exp()
    at = next(i for i in range(len(ids)) if ids[i : i + len(tokens)] == [t["id"] for t in tokens])
    assert at > 0 and all(t["p"] is not None for t in tokens)
    for j, t in enumerate(tokens):
        assert t["p"] == pytest.approx(float(probs[at + j - 1, ids[at + j]]), abs=1e-5)


@pytest.mark.parametrize(("frame", "words"), [
    ({"text": "a", "messages": CHAT}, "got both"),
    ({}, "got neither"),
    ({"messages": [{"role": "user", "content": "  "}]}, "needs text"),
    ({"text": "a", "alternatives": 21}, "alternatives"),
])
def test_bad_score_frames_are_named(live: Live, frame: dict[str, Any], words: str) -> None:
    msg = ask(live.url, {"type": "score", "id": "bad", **frame})[-1]
    assert msg["type"] == "error" and msg["id"] == "bad" and words in msg["message"]


def test_a_text_longer_than_the_context_is_refused(live: Live) -> None:
    msg = ask(live.url, {"type": "score", "id": "long", "text": "word " * 600})[-1]
    assert msg["type"] == "error" and msg["code"] == "prompt_too_long" and "256" in msg["message"]


# ---------------------------------------------------------------- finding the scored text in the prompt
def infos(pieces: list[str]) -> list[ev.TokenInfo]:
    return [ev.TokenInfo(id=i, piece=s) for i, s in enumerate(pieces)]


def test_locate_prefers_token_boundaries_and_cuts_the_ends() -> None:
    pieces = ["<|im_start|>", "user", "\n", "end", "<|im_end|>", "\n"]
    assert locate(pieces, "end") == (17, 20)  # not the "end" inside the marker after it
    found = target_tokens(infos(["<|im_start|>", "user", "\nHel", "lo", "<|im_end|>"]), "Hello")
    assert found is not None and [t.piece for t in found] == ["Hel", "lo"] and found[0].id == 2
    assert locate(["a", "b"], "zz") is None
    assert locate(["<s>", " Hi", " there", "</s>"], " Hi there ") == (3, 12)  # a template that strips the message


def test_locate_allows_for_characters_split_over_tokens_decoded_one_by_one() -> None:
    pieces = ["<|im_start|>", "user", "\n", "Hi", " \ufffd", "\ufffd", "\ufffd", "!", "<|im_end|>"]
    found = target_tokens(infos(pieces), "Hi 🎉!")
    assert found is not None and [t.piece for t in found] == ["Hi", " \ufffd", "\ufffd", "\ufffd", "!"]


# ---------------------------------------------------------------- a remote engine
def test_vllms_prompt_logprobs_become_the_scored_prompt() -> None:
    entries = [None, {"12": {"logprob": -2.0, "rank": 7, "decoded_token": " fox"},
                      "5": {"logprob": -0.1, "rank": 1, "decoded_token": " dog"},
                      "9": {"logprob": -1.5, "rank": 2, "decoded_token": " cat"}},
               {"3": {"logprob": -0.2, "rank": 1, "decoded_token": " runs"},
                "4": {"logprob": -2.5, "rank": 2, "decoded_token": " sits"}}]
    tokens = parse_prompt_logprobs(entries, 2, "The fox runs")
    assert [t.piece for t in tokens] == ["The", " fox", " runs"] and tokens[0].prob is None
    assert tokens[1].rank == 7 and [a for a, _, _ in tokens[1].top] == [5, 9]  # rank 7 > k: not among the top
    assert [a for a, _, _ in tokens[2].top] == [3, 4]  # rank 1 <= k: the prompt token is the top one
    assert tokens[1].prob == pytest.approx(0.1353, abs=1e-4)



@pytest.mark.parametrize(("logprob", "words"), [(1e308, "prompt_logprobs[1].logprob is 1e+308"),
                                                (float("nan"), "prompt_logprobs[1].logprob is NaN"),
                                                ("-1", "prompt_logprobs[1].logprob is str")])
def test_an_upstreams_impossible_prompt_logprob_is_its_error_naming_the_position(logprob: Any, words: str) -> None:
    entries = [None, {"12": {"logprob": logprob, "rank": 1, "decoded_token": " fox"}}]
    with pytest.raises(UpstreamError, match=re.escape(words)):
        parse_prompt_logprobs(entries, 2, "The fox")


def test_an_upstreams_flood_of_prompt_alternatives_is_cut_to_the_count_asked() -> None:
    flood = {str(i): {"logprob": -0.01 * i, "rank": 1, "decoded_token": f"t{i}"} for i in range(10_000)}
    tokens = parse_prompt_logprobs([None, flood], 3)
    assert len(tokens[1].top) == 3 and tokens[1].id == 0


def test_scoring_through_a_remote_webchat_equals_the_upstreams_own(live: Live) -> None:
    with front(live.url) as base:
        assert httpx.get(f"{base}/api/info").json()["engine"]["prompt_logprobs"] == "returned"
        frames = [{"type": "score", "id": "t", "text": "The fox jumps over the dog.", "alternatives": 3},
                  {"type": "score", "id": "m", "messages": CHAT, "alternatives": 3}]
        remote = [m for m in ask(base, *frames) if m["type"] == "scored"]
        local = [m for m in ask(live.url, *frames) if m["type"] == "scored"]
    assert len(remote) == len(local) == 2
    for r, o in zip(remote, local, strict=True):  # vLLM's prompt_logprobs say nothing of the first prompt token
        assert [t["id"] for t in r["tokens"][1:]] == [t["id"] for t in o["tokens"][1:]]
        assert "".join(t["text"] for t in r["tokens"]) == "".join(t["text"] for t in o["tokens"])
        assert [t["p"] for t in r["tokens"]] == pytest.approx([t["p"] for t in o["tokens"]], abs=1e-5)
        assert [[a["id"] for a in t["top"]] for t in r["tokens"][1:]] == [[a["id"] for a in t["top"]]
                                                                           for t in o["tokens"][1:]]


def test_an_upstream_without_prompt_logprobs_says_scoring_needs_them() -> None:
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(fake_upstream_app(), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.02)
    try:
        with front(f"http://127.0.0.1:{port}") as base, sync_connect(base.replace("http", "ws") + "/ws") as ws:
            hello = json.loads(ws.recv(10))
            assert hello["engine"]["prompt_logprobs"] == "absent"
            ws.send(json.dumps({"type": "score", "id": "x", "text": "Hello there"}))
            msg = json.loads(ws.recv(10))
            assert msg["type"] == "error" and msg["code"] == "scoring_unavailable"
            assert "scoring needs an engine with prompt logprobs" in msg["message"]
    finally:
        server.should_exit = True
        thread.join(10)


def test_the_scored_message_type_round_trips() -> None:
    msg = p.Scored(id="s", model="m", tokens=[p.TokenOut(id=1, text="a", p=None, rank=None, top=[])],
                   stats=p.Stats())
    shown = json.loads(p.dump(msg))["tokens"][0]
    assert shown["p"] is None and "forbidden" not in shown  # a prompt's tokens: no reply format refused any
