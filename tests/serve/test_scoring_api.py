"""Prompt scores through the OpenAI API (tiny model, real uvicorn): OpenAI's legacy `echo` with `logprobs`, vLLM's
`prompt_logprobs` on both endpoints, pure scoring with max_tokens 0, and the refusals (docs/api.md, "Scoring")."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from live_server import Live, serve  # tests/ is on sys.path under pytest
from test_openai_live import assert_error, openai_client, post

from webchat.model.kv_cache import SeqCache
from webchat.serve.config import ServerConfig
from webchat.serve.runtime import Runtime, load_runtime

pytestmark = pytest.mark.timeout(180)
TEXT = "def add(a, b):\n    return a + b  # Grüße 🎉 and a few more words"


@pytest.fixture(scope="module")
def runtime(tiny_model_dir: Path) -> Runtime:
    return load_runtime(ServerConfig(model_dir=tiny_model_dir, device="cpu", max_seq_len=256))


@pytest.fixture(scope="module")
def live(runtime: Runtime, tiny_model_dir: Path) -> Iterator[Live]:
    with serve(ServerConfig(model_dir=tiny_model_dir, device="cpu", max_seq_len=256), runtime) as server:
        yield server


def reference(runtime: Runtime, ids: list[int]) -> torch.Tensor:
    """log-softmax of one whole forward over ids: (len(ids), vocab); row i scores token i + 1."""
    model = runtime.local()[0]
    cache = SeqCache(model.new_pool(len(ids) + 16))
    return torch.log_softmax(cache.feed(model, ids, all_logits=True).float(), dim=-1)


def check_vllm_shape(scored: list[Any], ids: list[int], ref: torch.Tensor, k: int, runtime: Runtime) -> None:
    """[null, {id: {logprob, rank, decoded_token}}...]: the prompt token first, then its top k with ranks 1..k."""
    tok = runtime.local()[1]
    assert len(scored) == len(ids) and scored[0] is None
    for i in range(1, len(ids)):
        row, entry = ref[i - 1], scored[i]
        keys = list(entry)
        assert keys[0] == str(ids[i])
        own = entry[keys[0]]
        assert own["logprob"] == pytest.approx(float(row[ids[i]]), abs=1e-4)
        assert own["rank"] == int((row > row[ids[i]]).sum()) + 1
        assert own["decoded_token"] == tok.token_bytes(ids[i]).decode("utf-8", "replace")
        top = torch.topk(row, k).indices.tolist()
        assert set(keys) == {str(ids[i]), *map(str, top)}  # the prompt token once, beside the top k
        for rank, tid in enumerate(top, start=1):
            assert entry[str(tid)]["rank"] == rank
            assert entry[str(tid)]["logprob"] == pytest.approx(float(row[tid]), abs=1e-4)


def test_echo_scores_the_prompt_with_nothing_generated(live: Live, runtime: Runtime) -> None:
    """OpenAI's legacy shape through the official client: the prompt's tokens, the first with logprob null."""
    tok = runtime.local()[1]
    ids = tok.encode_text(TEXT)
    reply = openai_client(live).completions.create(model=runtime.model_name, prompt=TEXT, echo=True, logprobs=3,
                                                   max_tokens=0, temperature=0)
    choice = reply.choices[0]
    assert choice.text == TEXT and choice.finish_reason == "length"
    assert reply.usage is not None and (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (len(ids), 0)
    lp = choice.logprobs
    assert lp is not None and lp.tokens is not None and lp.token_logprobs is not None
    assert lp.top_logprobs is not None and lp.text_offset is not None
    assert len(lp.tokens) == len(ids) and "".join(lp.tokens) == TEXT
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    ref = reference(runtime, ids)
    for i in range(1, len(ids)):
        assert lp.token_logprobs[i] == pytest.approx(float(ref[i - 1, ids[i]]), abs=1e-4), i
        top = lp.top_logprobs[i]
        assert top is not None and 1 <= len(top) <= 3
        assert max(top.values()) == pytest.approx(float(ref[i - 1].max()), abs=1e-4)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(ids))]


def test_echo_then_generation_is_the_plain_completion_after_the_prompt(live: Live, runtime: Runtime) -> None:
    client = openai_client(live)
    plain = client.completions.create(model=runtime.model_name, prompt=TEXT, max_tokens=5, temperature=0, logprobs=2)
    echoed = client.completions.create(model=runtime.model_name, prompt=TEXT, max_tokens=5, temperature=0, logprobs=2,
                                       echo=True)
    n = len(runtime.local()[1].encode_text(TEXT))
    assert echoed.choices[0].text == TEXT + plain.choices[0].text
    a, b = plain.choices[0].logprobs, echoed.choices[0].logprobs
    assert a is not None and b is not None and b.tokens is not None and b.token_logprobs is not None
    assert b.tokens[n:] == a.tokens and b.token_logprobs[n:] == pytest.approx(a.token_logprobs, abs=1e-5)
    assert b.text_offset is not None and b.text_offset[n] == len(TEXT)
    text_only = client.completions.create(model=runtime.model_name, prompt=TEXT, max_tokens=5, temperature=0,
                                          echo=True)
    assert text_only.choices[0].text == TEXT + plain.choices[0].text and text_only.choices[0].logprobs is None
    streamed = list(client.completions.create(model=runtime.model_name, prompt=TEXT, max_tokens=5, temperature=0,
                                              logprobs=2, echo=True, stream=True))
    assert streamed[0].choices[0].text == TEXT  # the prompt comes first, with its scores
    first = streamed[0].choices[0].logprobs
    assert first is not None and first.token_logprobs is not None and first.token_logprobs[0] is None
    assert "".join(c.choices[0].text for c in streamed) == echoed.choices[0].text


def test_prompt_logprobs_in_vllms_shape_on_both_endpoints(live: Live, runtime: Runtime) -> None:
    tok = runtime.local()[1]
    ids = tok.encode_text(TEXT)
    body = {"model": runtime.model_name, "prompt": TEXT, "max_tokens": 2, "temperature": 0, "prompt_logprobs": 4}
    resp = post(live, "/v1/completions", body)
    assert resp.status_code == 200, resp.text
    check_vllm_shape(resp.json()["choices"][0]["prompt_logprobs"], ids, reference(runtime, ids), 4, runtime)
    messages = [{"role": "user", "content": TEXT}]
    chat_ids = tok.encode_chat(messages)
    resp = post(live, "/v1/chat/completions", {"model": runtime.model_name, "messages": messages, "max_tokens": 0,
                                               "prompt_logprobs": 2})
    assert resp.status_code == 200, resp.text
    out = resp.json()
    assert out["choices"][0]["message"]["content"] == "" and out["choices"][0]["finish_reason"] == "length"
    check_vllm_shape(out["prompt_logprobs"], chat_ids, reference(runtime, chat_ids), 2, runtime)  # vLLM's place
    zero = post(live, "/v1/completions", {**body, "prompt": ids, "prompt_logprobs": 0}).json()["choices"][0]
    assert all(len(e) == 1 for e in zero["prompt_logprobs"][1:])  # k = 0: the prompt token alone


def test_scoring_refusals_name_the_field(live: Live, runtime: Runtime) -> None:
    base = {"model": runtime.model_name, "prompt": "Hi there"}
    assert "echo: true or prompt_logprobs" in assert_error(
        post(live, "/v1/completions", {**base, "max_tokens": 0}), 400, "invalid_value", "max_tokens")
    assert_error(post(live, "/v1/completions", {**base, "prompt_logprobs": 21}), 400, "invalid_value",
                 "prompt_logprobs")
    assert "stream" in assert_error(post(live, "/v1/completions", {**base, "prompt_logprobs": 1, "stream": True}),
                                    400, "invalid_value", "prompt_logprobs")
    assert_error(post(live, "/v1/chat/completions", {"model": runtime.model_name, "max_tokens": 0,
                                                     "messages": [{"role": "user", "content": "Hi"}]}),
                 400, "invalid_value", "max_tokens")
    assert httpx.get(f"{live.url}/healthz").json()["active"] == 0


def test_a_p_of_zero_is_written_as_openai_writes_it() -> None:
    from webchat.serve.openai.scoring import logprob

    assert logprob(0.0) == -9999.0 and logprob(None) == -9999.0 and logprob(1.0) == 0.0
    assert logprob(0.5) == pytest.approx(math.log(0.5))


def test_lm_eval_local_completions_request_reads_the_continuation_loglikelihood(live: Live, runtime: Runtime) -> None:
    """lm-evaluation-harness's `local-completions` log-likelihood request and parse, as its openai_completions.py does
    them (0.4.x): token ids of context + continuation, echo, max_tokens 1, logprobs 1; sum(token_logprobs[ctxlen:-1])
    and is_greedy from top_logprobs. Both must be the model's own: the sum of ln p(continuation | context)."""
    tok = runtime.local()[1]
    ctx = tok.encode_text("Question: What colour is the sky?\nAnswer:")
    for cont_text in (" blue", " a shade of green"):
        cont = tok.encode_text(cont_text)
        body = {"model": runtime.model_name, "prompt": [ctx + cont], "temperature": 0, "max_tokens": 1,
                "logprobs": 1, "seed": 1234, "echo": True}
        resp = post(live, "/v1/completions", body)
        assert resp.status_code == 200, resp.text
        choice = resp.json()["choices"][0]
        lps = choice["logprobs"]["token_logprobs"][len(ctx):-1]
        tops = choice["logprobs"]["top_logprobs"][len(ctx):-1]
        assert len(lps) == len(cont)
        ids = ctx + cont
        ref = reference(runtime, ids)
        want = sum(float(ref[len(ctx) + j - 1, cont[j]]) for j in range(len(cont)))
        assert sum(lps) == pytest.approx(want, abs=1e-4)
        greedy = all(lp == max(top.values()) for lp, top in zip(lps, tops, strict=True))
        assert greedy == all(int(ref[len(ctx) + j - 1].argmax()) == cont[j] for j in range(len(cont)))


def test_prompt_scores_are_the_same_without_the_cpu_row_scan(runtime: Runtime) -> None:
    """engine.sampling.describe: the C++ row scan (the CPU's) and the torch path (a GPU's logits, or no kernels) give
    a scored prompt the same probabilities, ranks and alternatives."""
    from webchat.engine.sampling import describe

    scan = runtime.local()[0].row_scan
    assert scan is not None, "the tiny model on the CPU has the C++ row scan"
    logits = torch.randn(6, 512, generator=torch.Generator().manual_seed(0)) * 4
    rows, tokens = [0, 2, 3, 5], [7, 100, 3, 511]
    a, b = describe(logits, rows, tokens, 5, scan), describe(logits, rows, tokens, 5, None)
    for x, y in zip(a, b, strict=True):
        assert x.prob == pytest.approx(y.prob, rel=1e-5) and x.rank == y.rank
        assert [t for t, _ in x.top] == [t for t, _ in y.top]
        assert [p for _, p in x.top] == pytest.approx([p for _, p in y.top], rel=1e-5)


def test_echo_lists_the_stop_token_that_ended_the_completion(live: Live, runtime: Runtime) -> None:
    """A completion that ends on a stop token keeps it as its last legacy entry (text ""), so the entries are the
    prompt's tokens and every sampled one, as vLLM's echo gives them (lm-eval drops the last one). The bias makes the
    stop token the greedy choice; its logprob is still the model's raw one."""
    tok = runtime.local()[1]
    ids = tok.encode_text(TEXT)
    stop = tok.stop_token_ids[0]
    for stream in (False, True):
        body = {"model": runtime.model_name, "prompt": ids, "max_tokens": 1, "temperature": 0, "logprobs": 2,
                "echo": True, "logit_bias": {str(stop): 100}, "stream": stream}
        if stream:
            with httpx.stream("POST", f"{live.url}/v1/completions", json=body, timeout=60) as resp:
                chunks = [json.loads(line[6:]) for line in resp.iter_lines() if line.startswith("data: {")]
            lp = {k: [v for c in chunks if c["choices"][0]["logprobs"] for v in c["choices"][0]["logprobs"][k]]
                  for k in ("tokens", "token_logprobs")}
            text, reason = "".join(c["choices"][0]["text"] for c in chunks), chunks[-1]["choices"][0]["finish_reason"]
        else:
            choice = post(live, "/v1/completions", body).json()["choices"][0]
            lp, text, reason = choice["logprobs"], choice["text"], choice["finish_reason"]
        assert reason == "stop" and text == TEXT
        assert len(lp["tokens"]) == len(ids) + 1 and lp["tokens"][-1] == ""
        assert lp["token_logprobs"][-1] == pytest.approx(float(reference(runtime, ids)[-1, stop]), abs=1e-4)
    plain = post(live, "/v1/completions", {**body, "echo": False, "stream": False}).json()["choices"][0]
    assert plain["logprobs"]["tokens"] == []  # without echo the legacy logprobs keep listing generated text only
