"""webchat.serve.remote.parse on stream chunks shaped as vLLM, SGLang and llama.cpp's server send them.

The chunks below were written from the engines' documented schemas, NOT recorded from a running vLLM, SGLang or
llama-server (none runs in this suite):
  vLLM:      vllm/entrypoints/openai/protocol.py — ChatCompletionLogProbsContent {token, logprob, bytes,
             top_logprobs}, ChatCompletionResponseStreamChoice {delta, logprobs, finish_reason, stop_reason,
             token_ids (with return_token_ids)}; byte-fallback tokens are spelled "bytes:\\xNN".
  SGLang:    python/sglang/srt/entrypoints/openai/protocol.py — the same ChatCompletionTokenLogprob shape; several
             tokens can come in one chunk.
  llama.cpp: tools/server/README.md — each logprobs entry has `id`, `token`, `bytes`, `logprob` and `top_logprobs`,
             or `prob` and `top_probs` under post_sampling_probs.
Further down, llama-server's answers ARE recorded: tests/fixtures/llama_server.json, written by
bench/record_llama_server.py from the build of bench/build_llama_server.sh (its build_info is in the file).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from webchat.serve.remote.parse import NO_ID, ChunkError, StreamParser, sse_data


def lp(p: float) -> float:
    return math.log(p)


def entry(token: str, p: float, top: list[tuple[str, float]], raw: bytes | None = None, **extra: object) -> dict:
    e: dict[str, object] = {"token": token, "logprob": lp(p), **extra,
                            "top_logprobs": [{"token": t, "logprob": lp(q), "bytes": list(t.encode())} for t, q in top]}
    if raw is not None:
        e["bytes"] = list(raw)
    return e


def chunk(entries: list[dict] | None, content: str = "", finish: str | None = None, **choice: object) -> dict:
    c: dict[str, object] = {"index": 0, "delta": {"content": content}, "finish_reason": finish, **choice}
    if entries is not None:
        c["logprobs"] = {"content": entries}
    return {"id": "chatcmpl-1", "object": "chat.completion.chunk", "choices": [c]}


def test_vllm_token_ids_bytes_and_rank() -> None:
    parser = StreamParser()
    out = parser.feed(chunk([entry("Hello", 0.6, [("Hello", 0.6), ("Hi", 0.3)], b"Hello")], "Hello",
                            token_ids=[9906]))
    assert out.text == "Hello"
    (tok,) = out.tokens
    assert tok.id == 9906 and tok.piece == "Hello" and tok.rank == 1
    assert tok.prob == pytest.approx(0.6)
    assert [(t[1], round(t[2], 6)) for t in tok.top] == [("Hello", 0.6), ("Hi", 0.3)]
    # vLLM's chat alternatives carry no ids: only the one that is the sampled token gets that token's id
    assert [t[0] for t in tok.top] == [9906, NO_ID]


def test_split_utf8_bytes_render_whole_on_the_completing_token() -> None:
    """'é' is c3 a9: vLLM spells each byte token 'bytes:\\xc3'; the text shows the character once, whole."""
    parser = StreamParser()
    first = parser.feed(chunk([entry("bytes:\\xc3", 0.5, [("bytes:\\xc3", 0.5)], b"\xc3")], ""))
    second = parser.feed(chunk([entry("bytes:\\xa9", 0.9, [("bytes:\\xa9", 0.9)], b"\xa9")], "é"))
    assert first.tokens[0].piece == "" and second.tokens[0].piece == "é"
    assert first.text + second.text == "é"
    assert "\ufffd" not in first.text + second.text


def test_sglang_several_tokens_in_one_chunk_each_with_its_own_alternatives() -> None:
    parser = StreamParser()
    out = parser.feed(chunk([entry(" the", 0.7, [(" the", 0.7), (" a", 0.2)], b" the"),
                             entry(" cat", 0.1, [(" dog", 0.5), (" bird", 0.3)], b" cat")], " the cat"))
    assert out.text == " the cat"
    assert [t.piece for t in out.tokens] == [" the", " cat"]
    assert out.tokens[0].rank == 1 and [a[1] for a in out.tokens[0].top] == [" the", " a"]
    assert out.tokens[1].rank is None  # outside the top-k: unknown, not zero
    assert [a[1] for a in out.tokens[1].top] == [" dog", " bird"]


def test_llama_cpp_ids_and_post_sampling_probs() -> None:
    parser = StreamParser()
    raw = {"id": 42, "token": "Hi", "bytes": list(b"Hi"), "logprob": lp(0.25),
           "top_logprobs": [{"id": 7, "token": "Yo", "bytes": list(b"Yo"), "logprob": lp(0.5)},
                            {"id": 42, "token": "Hi", "bytes": list(b"Hi"), "logprob": lp(0.25)}]}
    tok = parser.feed(chunk([raw], "Hi")).tokens[0]
    assert tok.id == 42 and tok.rank == 2 and [a[0] for a in tok.top] == [7, 42]
    post = {"id": 5, "token": "!", "bytes": [33], "prob": 0.8, "top_probs": [{"id": 5, "token": "!", "prob": 0.8}]}
    tok = parser.feed(chunk([post], "!", "stop")).tokens[0]
    assert tok.prob == pytest.approx(0.8) and tok.rank == 1


def test_missing_fields_are_none_not_zero() -> None:
    """No bytes: the token's string; no logprob: p unknown; no top_logprobs: no alternatives, rank unknown."""
    tok = StreamParser().feed(chunk([{"token": "ok"}], "ok")).tokens[0]
    assert tok.piece == "ok" and tok.prob is None and tok.rank is None and tok.top == []
    assert StreamParser().feed(chunk(None, "plain")).text == "plain"  # no logprobs at all: the delta's content


def test_finish_reasons_and_usage() -> None:
    assert StreamParser().feed(chunk(None, "", "length")).reason == "max_new_tokens"
    assert StreamParser().feed(chunk(None, "", "stop")).reason == "stop_token"
    out = StreamParser().feed(chunk(None, "", "stop", stop_reason="END"))
    assert (out.reason, out.trigger) == ("stop_string", "END")
    usage = StreamParser().feed({"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 3}}).usage
    assert usage == {"prompt_tokens": 5, "completion_tokens": 3}


def test_character_cut_at_the_end_is_dropped_and_stray_bytes_are_replaced() -> None:
    """As webchat.text.detok: an unfinished trailing character is dropped; a stray continuation byte is U+FFFD."""
    parser = StreamParser()
    assert parser.feed(chunk([entry("x", 0.5, [], b"\x80a")], "")).text == "\ufffda"
    parser.feed(chunk([entry("x", 0.5, [], b"\xe2\x82")], ""))
    end = parser.feed(chunk(None, "", "length"))
    assert end.text == ""


@pytest.mark.parametrize(("bad", "words"), [
    ([1, 2], "JSON object"),
    ({"choices": "x"}, "'choices'"),
    ({"choices": [3]}, r"choices\[0\]"),
    ({"error": {"message": "out of memory", "code": 500}}, "^out of memory$"),
    ({"choices": [{"delta": {}, "logprobs": {"content": [{"logprob": -1.0}]}}]}, "'bytes'"),
])
def test_malformed_chunks_are_named(bad: object, words: str) -> None:
    with pytest.raises(ChunkError, match=words):
        StreamParser().feed(bad)


def test_sse_lines() -> None:
    assert sse_data('data: {"a":1}') == '{"a":1}'
    assert sse_data("data:[DONE]") == "[DONE]"
    assert sse_data(": keep-alive") is None and sse_data("") is None


# ---------------------------------------------------------------- what is sent, per engine (RemoteEngine.body)
def _body(kind: str, **caps: object) -> dict:
    from webchat.engine.sequence import GenerationRequest
    from webchat.engine.settings import SamplingSettings
    from webchat.serve.backend import Job
    from webchat.serve.remote.capabilities import Capabilities
    from webchat.serve.remote.client import Upstream
    from webchat.serve.remote.engine import RemoteEngine

    c = Capabilities(url="http://up", state="ready", kind=kind, model="m", **caps)  # type: ignore[arg-type]
    engine = RemoteEngine(Upstream("http://up:1"), c, max_active=1, max_queue=0)
    req = GenerationRequest(prompt_ids=[], settings=SamplingSettings(temperature=0.0, repetition_penalty=1.1),
                            max_new_tokens=7, stop_strings=["END"], return_probs=True, top_alts=8)
    msgs = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hel"}]
    return engine.body(Job(key=1, request_id="r", request=req, deliver=print, messages=msgs, continue_final=True))


def test_vllm_body_continues_with_continue_final_message_and_asks_for_ids() -> None:
    body = _body("vllm", max_top_logprobs=5, token_ids="return_token_ids", continue_final="continue_final_message")
    assert body["continue_final_message"] is True and body["add_generation_prompt"] is False
    assert body["return_token_ids"] is True and body["top_logprobs"] == 5  # capped at what the upstream accepts
    assert body["max_tokens"] == 7 and body["stop"] == ["END"] and body["repetition_penalty"] == 1.1
    assert body["messages"][-1] == {"role": "assistant", "content": "Hel"}
    assert body["user"].startswith("webchat-") and body["stream"] is True


def test_llama_cpp_body_relies_on_the_final_assistant_message() -> None:
    body = _body("llama.cpp", max_top_logprobs=20, token_ids="per_entry", continue_final="final_assistant_message")
    assert "continue_final_message" not in body and "return_token_ids" not in body
    assert body["messages"][-1]["role"] == "assistant" and body["top_logprobs"] == 8
    assert body["repeat_penalty"] == 1.1 and "repetition_penalty" not in body


def test_unknown_engine_gets_only_openai_fields_and_the_key_is_stable_per_conversation() -> None:
    body = _body("openai-compatible", max_top_logprobs=0)
    assert "top_k" not in body and "min_p" not in body and "top_logprobs" not in body and body["logprobs"] is True
    from webchat.serve.remote.engine import conversation_key

    first = [{"role": "system", "content": "S"}, {"role": "user", "content": "Q1"}]
    later = [*first, {"role": "assistant", "content": "A1"}, {"role": "user", "content": "Q2"}]
    assert conversation_key(first) == conversation_key(later) != conversation_key([{"role": "user", "content": "x"}])


def test_a_job_stopped_before_its_task_ran_frees_its_slot_and_is_answered() -> None:
    """cancel() in the same loop turn as submit(): the task never starts, so `_run`'s handlers never run."""
    import asyncio

    from webchat.engine import events as ev
    from webchat.engine.sequence import GenerationRequest
    from webchat.engine.settings import SamplingSettings
    from webchat.serve.backend import Job
    from webchat.serve.remote.capabilities import Capabilities
    from webchat.serve.remote.client import Upstream
    from webchat.serve.remote.engine import RemoteEngine

    async def scenario() -> tuple[list[object], list[object], object]:
        caps = Capabilities(url="http://up:1", state="unreachable", error="down")
        engine = RemoteEngine(Upstream("http://up:1"), caps, max_active=1, max_queue=1)
        req = GenerationRequest(prompt_ids=[], settings=SamplingSettings(), max_new_tokens=4)
        first: list[object] = []
        second: list[object] = []
        engine.submit(Job(key=1, request_id="a", request=req, deliver=first.append, messages=[]))
        engine.cancel(1, "a")
        engine.submit(Job(key=2, request_id="b", request=req, deliver=second.append, messages=[]))
        engine.cancel(2, "b")
        for _ in range(5):
            await asyncio.sleep(0)
        return first, second, engine.snapshot()

    first, second, snap = asyncio.run(scenario())
    assert [type(e) for e in first] == [ev.Finished] and first[0].reason == "cancelled"  # type: ignore[attr-defined]
    assert [type(e) for e in second] == [ev.Queued, ev.Finished]  # it waited behind the first, then was stopped
    assert second[1].reason == "cancelled"  # type: ignore[attr-defined]
    assert snap.active == [] and snap.pending == []  # type: ignore[attr-defined]


# ---------------------------------------------------------------- recorded from llama-server
RECORDED = Path(__file__).parents[1] / "fixtures" / "llama_server.json"  # bench/record_llama_server.py wrote it


def recorded() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(RECORDED.read_text())
    assert data["build_info"] and data["recorded_by"] == "bench/record_llama_server.py"
    return data


def parse_all(chunks: list[Any]) -> tuple[str, list[Any], str | None]:
    parser, text, tokens, reason = StreamParser(), "", [], None
    for c in chunks:
        out = parser.feed(c)
        text += out.text
        tokens += out.tokens
        reason = out.reason or reason
    return text, tokens, reason


def test_recorded_llama_server_chat_stream() -> None:
    data = recorded()["chat"]
    text, tokens, reason = parse_all(data["chunks"])
    sent = "".join((c["choices"][0]["delta"].get("content") or "") for c in data["chunks"] if c.get("choices"))
    assert text == sent and text and reason == "max_new_tokens"
    assert len(tokens) == data["request"]["max_tokens"]
    for t in tokens:  # greedy: each token is its own first alternative, ids on the token and every alternative
        assert t.id >= 0 and t.rank == 1 and len(t.top) == 3 and t.top[0][0] == t.id
        assert all(a[0] >= 0 for a in t.top) and 0.0 < t.prob <= 1.0


def test_recorded_llama_server_post_sampling_probs() -> None:
    _, tokens, _ = parse_all(recorded()["chat_post_sampling"]["chunks"])
    assert tokens and all(t.prob is not None and t.rank == 1 and t.id >= 0 for t in tokens)


def test_recorded_llama_server_completion_after_token_ids_continues_the_reply_exactly() -> None:
    """The chat's template text then the reply's first ids, as one mixed prompt: the same next tokens and p."""
    data = recorded()
    _, chat, _ = parse_all(data["chat"]["chunks"])
    request = data["completion_after_ids"]["request"]
    assert request["prompt"][0] == data["apply_template"]["response"]["prompt"]
    head = request["prompt"][1:]
    assert head == [t.id for t in chat[: len(head)]]
    text, more, _ = parse_all(data["completion_after_ids"]["chunks"])
    assert text and [t.id for t in more] == [t.id for t in chat[len(head):]][: len(more)]
    n = min(len(more), len(chat) - len(head))
    assert n >= 8
    assert [t.prob for t in more[:n]] == pytest.approx([t.prob for t in chat[len(head):len(head) + n]], abs=1e-4)


def test_vllm_legacy_completion_chunks_with_token_ids() -> None:
    """vLLM's text completion stream (protocol.py CompletionLogProbs {text_offset, token_logprobs, tokens,
    top_logprobs: [{text: logprob}]}, CompletionResponseStreamChoice.token_ids with return_token_ids), written from
    its schema, not recorded: an alternative gets an id only where it is the sampled token."""
    c = {"id": "cmpl-1", "object": "text_completion", "choices": [{
        "index": 0, "text": " fox jumps", "token_ids": [11, 12], "finish_reason": None,
        "logprobs": {"tokens": [" fox", " jumps"], "token_logprobs": [lp(0.5), lp(0.9)], "text_offset": [0, 4],
                     "top_logprobs": [{" fox": lp(0.5), " dog": lp(0.3)}, {" jumps": lp(0.9)}]}}]}
    out = StreamParser().feed(c)
    assert out.text == " fox jumps" and [t.id for t in out.tokens] == [11, 12]
    first = out.tokens[0]
    assert first.rank == 1 and first.prob == pytest.approx(0.5)
    assert [(a[0], a[1]) for a in first.top] == [(11, " fox"), (NO_ID, " dog")]
    plain = StreamParser().feed({"choices": [{"index": 0, "text": "ok", "finish_reason": "length"}]})
    assert plain.text == "ok" and plain.tokens == [] and plain.reason == "max_new_tokens"
    with pytest.raises(ChunkError, match="token_logprobs"):
        StreamParser().feed({"choices": [{"index": 0, "text": "x", "logprobs": {"tokens": ["x"]}}]})


@pytest.mark.parametrize(("how", "sent"), [("tokenize", [5, 6, 7, 40, 41]), ("apply_template", ["<chat>", 40, 41])])
def test_a_branch_given_as_ids_is_a_text_completion_on_the_chats_prompt(how: str, sent: list[Any]) -> None:
    import asyncio

    from webchat.engine.sequence import GenerationRequest
    from webchat.engine.settings import SamplingSettings
    from webchat.serve.backend import Job
    from webchat.serve.remote.capabilities import Capabilities
    from webchat.serve.remote.client import Upstream
    from webchat.serve.remote.engine import RemoteEngine

    kind = "vllm" if how == "tokenize" else "llama.cpp"
    caps = Capabilities(url="http://up", state="ready", kind=kind, model="m", max_top_logprobs=5,
                        token_ids="per_entry", continue_final="continue_final_message", token_prompt=how)
    engine = RemoteEngine(Upstream("http://up:1"), caps, max_active=1, max_queue=0)
    calls: list[tuple[str, dict[str, Any]]] = []

    async def post_json(path: str, body: dict[str, Any]) -> Any:
        calls.append((path, body))
        return {"tokens": [5, 6, 7]} if path == "/tokenize" else {"prompt": "<chat>"}

    engine.upstream.post_json = post_json  # type: ignore[method-assign]
    req = GenerationRequest(prompt_ids=[], settings=SamplingSettings(temperature=0.0), max_new_tokens=7,
                            return_probs=True, top_alts=8)
    msgs = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hel"}]
    job = Job(key=1, request_id="r", request=req, deliver=print, messages=msgs, continue_final=True,
              prefix_ids=[40, 41])
    assert engine.by_ids(job)
    body = asyncio.run(engine.completion_body(job))
    assert body["prompt"] == sent and body["logprobs"] == 5 and body["max_tokens"] == 7 and body["stream"] is True
    assert "messages" not in body and "top_logprobs" not in body and "continue_final_message" not in body
    assert ("return_token_ids" in body) == (kind == "vllm")
    assert calls[0][1]["messages"] == msgs[:1]  # the chat without the reply being branched
    assert not engine.by_ids(Job(key=2, request_id="t", request=req, deliver=print, messages=msgs,
                                 continue_final=True))  # no ids: continued as text
    caps.token_prompt = "absent"
    assert not engine.by_ids(job)
