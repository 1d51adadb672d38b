"""The OpenAI API's request validation and response formatting, without a server."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest

from webchat.engine import events as ev
from webchat.engine.settings import SamplingSettings
from webchat.serve.openai.format import Reply, logprob, merge
from webchat.serve.openai.schema import OPENAI_DEFAULTS, APIError, ChatRequest, CompletionRequest, parse
from webchat.text.tokenizer import Tokenizer

CHAT = b'{"model": "m", "messages": [{"role": "user", "content": "hi"}]'


def chat(extra: str = "") -> ChatRequest:
    req: ChatRequest = parse(ChatRequest, CHAT + (b", " + extra.encode() if extra else b"") + b"}")
    return req


def error(call: Any) -> APIError:
    with pytest.raises(APIError) as info:
        call()
    return info.value


def test_nulls_mean_defaults_and_the_defaults_are_openais() -> None:
    req = chat('"temperature": null, "top_p": null, "stop": null, "n": null, "logit_bias": null, "user": "u"')
    settings = req.sampling(vocab_size=100)
    assert settings == SamplingSettings(**OPENAI_DEFAULTS)
    assert (settings.temperature, settings.top_k, settings.min_p) == (1.0, 0, 0.0)
    assert req.stops() == [] and req.limit() is None


def test_extensions_and_integers_for_floats() -> None:
    settings = chat('"temperature": 0, "top_k": 5, "min_p": 0.1, "logit_bias": {"7": -100}, "seed": 3').sampling(100)
    assert (settings.temperature, settings.top_k, settings.min_p, settings.seed) == (0.0, 5, 0.1, 3)
    assert settings.token_bias == {7: -100.0}


@pytest.mark.parametrize(("extra", "param", "says"), [
    ('"stop": 5', "stop", "expected a string or a list of strings, got 5"),
    ('"max_tokens": true', "max_tokens", "valid integer"),
    ('"messages": [{"role": "user", "content": 5}]', "messages", "expected a string or a list of content parts"),
    ('"messages": [{"role": "robot", "content": "x"}]', "messages.0.role", 'got "robot"'),
    ('"messages": [{"role": "tool", "content": "x"}]', "messages.0", "needs tool_call_id"),
    ('"messages": [{"role": "user", "content": null}]', "messages.0", "content is required"),
    ('"frobnicate": 1', "frobnicate", "not supported"),
])
def test_type_errors_name_the_field(extra: str, param: str, says: str) -> None:
    body = CHAT + b", " + extra.encode() + b"}"
    exc = error(lambda: parse(ChatRequest, body))
    assert exc.status == 400 and exc.param is not None and exc.param.startswith(param) and says in exc.message, exc


def test_ranges_come_from_sampling_settings() -> None:
    exc = error(lambda: chat('"top_p": 0').sampling(100))
    assert (exc.param, exc.message) == ("top_p", "top_p must be a number in (0, 1], got 0.0")
    exc = error(lambda: chat('"logit_bias": {"x": 1}').sampling(100))
    assert exc.param == "logit_bias" and "'x'" in exc.message
    exc = error(lambda: chat('"stop": ""').stops())
    assert exc.param == "stop" and "got 0" in exc.message


def test_messages_for_the_template() -> None:
    req = chat().model_copy(update={"messages": parse(ChatRequest, b'{"model": "m", "messages": ['
                                                      b'{"role": "developer", "content": "be brief"},'
                                                      b'{"role": "user", "content": [{"type": "text", "text": "a"},'
                                                      b'{"type": "text", "text": "b"}]}]}').messages})
    assert [m.for_template() for m in req.messages] == [{"role": "system", "content": "be brief"},
                                                        {"role": "user", "content": "a\nb"}]


def test_completion_prompts() -> None:
    def one(prompt: str) -> str | list[int]:
        return parse(CompletionRequest, b'{"model": "m", "prompt": ' + prompt.encode() + b"}").one_prompt()

    assert one('"hi"') == "hi" and one("[1, 2]") == [1, 2] and one('["hi"]') == "hi" and one("[[3]]") == [3]
    assert "2 prompts" in error(lambda: one('["a", "b"]')).message
    echo = parse(CompletionRequest, b'{"model": "m", "prompt": "x", "echo": true, "max_tokens": 0}')
    echo.check()  # pure scoring: the prompt is run for its text, nothing generated
    assert echo.scored() == 0
    assert parse(CompletionRequest, b'{"model": "m", "prompt": "x", "echo": true, "logprobs": 3}').scored() == 3
    assert parse(CompletionRequest, b'{"model": "m", "prompt": "x", "echo": true}').scored() is None
    assert error(lambda: parse(CompletionRequest, b'{"model": "m", "prompt": "x", "max_tokens": 0}').check()).param \
        == "max_tokens"


def test_encode_text_reads_special_tokens_as_characters(tiny_model_dir: Path) -> None:
    tok = Tokenizer.from_dir(tiny_model_dir)
    end = tok.encode("<|im_end|>")
    assert len(end) == 1 and end[0] in tok.stop_token_ids  # Tokenizer.encode parses the marker
    plain = tok.encode_text("Hi <|im_end|>")
    assert end[0] not in plain and tok.decode(plain) == "Hi <|im_end|>"
    assert tok.encode_text("Hello world") == tok.encode("Hello world")  # ordinary text: the same ids


class FakeTokenizer:
    def token_bytes(self, tid: int) -> bytes:
        return bytes([tid])


def info(tid: int, piece: str, p: float, top: list[tuple[int, str, float]]) -> ev.TokenInfo:
    return ev.TokenInfo(id=tid, piece=piece, prob=p, rank=1, top=top)


def test_chat_chunks_and_logprobs() -> None:
    reply = Reply(chat=True, model="m", tokenizer=FakeTokenizer(), logprobs=1, include_usage=True)
    first = reply.chunk(ev.Tokens("", [info(200, "", 0.5, [(200, "<0xC8>", 0.5)])]))  # half a character: no text
    assert first is not None and first["choices"][0]["delta"] == {"content": ""} and first["usage"] is None
    entry = first["choices"][0]["logprobs"]["content"][0]
    assert entry == {"id": 200, "token": "", "logprob": math.log(0.5), "bytes": [200],
                     "top_logprobs": [{"id": 200, "token": "<0xC8>", "logprob": math.log(0.5), "bytes": [200]}]}
    reply.chunk(ev.Tokens("é", [info(201, "é", 0.25, [])]))
    done = ev.Finished("max_new_tokens", None, ev.Stats(prompt_tokens=5, new_tokens=2))
    finish, usage = reply.finish_chunks(done)
    assert finish["choices"][0]["finish_reason"] == "length" and usage["choices"] == []
    assert finish["stats"]["new_tokens"] == 2 and "stats" not in usage and "stats" not in first
    assert usage["usage"] == {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7}
    whole = reply.response(done)
    assert whole["object"] == "chat.completion" and whole["choices"][0]["message"]["content"] == "é"
    assert [e["token"] for e in whole["choices"][0]["logprobs"]["content"]] == ["", "é"]
    assert Reply(chat=True, model="m", tokenizer=None).chunk(ev.Tokens("", [info(1, "", 0.5, [])])) is None


def test_text_completion_legacy_logprobs() -> None:
    reply = Reply(chat=False, model="m", tokenizer=FakeTokenizer(), logprobs=2)
    reply.add(ev.Tokens("ab", [info(1, "a", 0.5, [(1, "a", 0.5), (9, "a", 0.1)]), info(2, "b", 0.0, [])]))
    lp = reply.response(ev.Finished("stop_string", "x", ev.Stats()))["choices"][0]["logprobs"]
    assert lp == {"tokens": ["a", "b"], "token_logprobs": [math.log(0.5), -9999.0],
                  "top_logprobs": [{"a": math.log(0.5)}, {}], "text_offset": [0, 1]}


def test_return_token_ids_puts_each_chunks_ids_on_its_choice() -> None:
    reply = Reply(chat=False, model="m", tokenizer=FakeTokenizer(), token_ids=True)
    first = reply.chunk(ev.Tokens("ab", [info(7, "a", 0.5, []), info(8, "b", 0.5, [])]))
    second = reply.chunk(ev.Tokens("c", [info(9, "c", 0.5, [])]))
    assert first is not None and second is not None
    assert first["choices"][0]["token_ids"] == [7, 8] and second["choices"][0]["token_ids"] == [9]
    assert reply.response(ev.Finished("stop_token", None, ev.Stats()))["choices"][0]["token_ids"] == [7, 8, 9]
    plain = Reply(chat=True, model="m", tokenizer=FakeTokenizer()).chunk(ev.Tokens("a", [info(7, "a", 0.5, [])]))
    assert plain is not None and "token_ids" not in plain["choices"][0]


def test_merge_joins_consecutive_tokens_only() -> None:
    a, b = ev.Tokens("a", [info(1, "a", 1.0, [])]), ev.Tokens("b", [info(2, "b", 1.0, [])])
    merged = merge([ev.Queued(1), a, b, ev.Finished("stop_token", None, ev.Stats())])
    assert [type(e).__name__ for e in merged] == ["Queued", "Tokens", "Finished"]
    assert isinstance(merged[1], ev.Tokens) and merged[1].text == "ab" and len(merged[1].tokens) == 2
    assert logprob(None) == logprob(0.0) == -9999.0


def test_api_key_flag_and_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    import argparse

    from webchat.cli.serve import add_arguments, config_from_args

    def key(argv: list[str]) -> str | None:
        parser = argparse.ArgumentParser()
        add_arguments(parser)
        return config_from_args(parser.parse_args(argv), Path("m")).api_key

    monkeypatch.delenv("WEBCHAT_API_KEY", raising=False)
    assert key([]) is None and key(["--api-key", "k1"]) == "k1"
    monkeypatch.setenv("WEBCHAT_API_KEY", "k2")
    assert key([]) == "k2" and key(["--api-key", "k1"]) == "k1"


@pytest.mark.parametrize("key", ["\u00b2", "\u0663", "9" * 5000, "-1", "100"])
def test_logit_bias_keys_are_ascii_token_ids_in_the_vocabulary(key: str) -> None:
    """"²" passes str.isdigit() but int() refuses it, "٣" int() reads as 3, 5,000 digits pass Python's int limit:
    every one is a 400 naming logit_bias (issue 23), never a 500."""
    req = parse(ChatRequest, ('{"model": "m", "messages": [{"role": "user", "content": "x"}], "logit_bias": {"'
                              + key + '": 1}}').encode())
    with pytest.raises(APIError) as e:
        req.sampling(vocab_size=100)
    assert e.value.status == 400 and e.value.code == "invalid_value" and e.value.param == "logit_bias", e.value.body()
    assert "ASCII digits" in e.value.message and len(e.value.message) < 300


@pytest.mark.parametrize("body", [
    b'{"model": "m", "messages": [{"role": "user", "content": "a\\ud800b"}]}',
    b'{"model": "m", "messages": [{"role": "user", "content": "ok"}], "stop": ["\\udfff"]}',
])
def test_a_lone_surrogate_is_refused_by_name(body: bytes) -> None:
    with pytest.raises(APIError) as e:
        parse(ChatRequest, body)
    assert e.value.status == 400 and "lone surrogate" in e.value.message, e.value.body()
    assert e.value.param in ("messages.0.content", "stop.0")


def test_a_lone_surrogate_in_a_completion_prompt_is_refused_by_name() -> None:
    with pytest.raises(APIError) as e:
        parse(CompletionRequest, b'{"model": "m", "prompt": "x\\ud83d"}')
    assert e.value.status == 400 and e.value.param == "prompt"
