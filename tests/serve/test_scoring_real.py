"""Prompt scores on the real default model against transformers in float32 on the same weights (issue 41): four texts
(English, German with umlauts and an emoji, code, one longer than a prefill chunk), through `echo` and through
`prompt_logprobs`, alone and while 8 other streams decode; every logprob within 1e-3 of the reference."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from live_server import Live, serve  # tests/ is on sys.path under pytest
from test_scoring_ws import ask

from webchat.engine.engine import PREFILL_CHUNK
from webchat.serve.config import ServerConfig
from webchat.serve.runtime import Runtime, load_runtime

pytestmark = [pytest.mark.real_model, pytest.mark.timeout(900)]
TOLERANCE = 1e-3
K = 5
LONG = " ".join(["The committee met on Tuesday to discuss the budget for the new library, and after a long debate "
                 "about opening hours, staffing and the children's reading room, it agreed to publish a draft plan "
                 "for comment before the end of the month."] * 8)
TEXTS = {
    "english": "The quick brown fox jumps over the lazy dog, and then it runs back into the forest.",
    "german": "Größere Übungen für Schüler: Ärger über die Prüfung 🎉 war gestern.",
    "code": "def fib(n: int) -> int:\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n\nprint(fib(10))\n",
    "long": LONG,
}


# the exact path where the server has two precisions (an int8-activation fast path may become the CPU's default)
EXACT: dict[str, Any] = {"exact": True} if "exact" in ServerConfig.__dataclass_fields__ else {}


@pytest.fixture(scope="module")
def config(real_model_dir: Path) -> ServerConfig:
    return ServerConfig(model_dir=real_model_dir, device="cpu", max_seq_len=2048, **EXACT)


@pytest.fixture(scope="module")
def runtime(config: ServerConfig) -> Runtime:
    return load_runtime(config)


@pytest.fixture(scope="module")
def live(config: ServerConfig, runtime: Runtime) -> Iterator[Live]:
    with serve(config, runtime) as server:
        yield server


@pytest.fixture(scope="module")
def references(real_model_dir: Path, runtime: Runtime) -> dict[str, tuple[list[int], torch.Tensor]]:
    """Each text's ids (webchat's tokenizer) and transformers' float32 log-softmax over them, (len, vocab)."""
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(real_model_dir, dtype=torch.float32).eval()
    tok = runtime.local()[1]
    out = {}
    for name, text in TEXTS.items():
        ids = tok.encode_text(text)
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0].float()
        out[name] = (ids, torch.log_softmax(logits, dim=-1))
    assert len(out["long"][0]) > PREFILL_CHUNK, "the long text must span more than one prefill chunk"
    return out


def score(live: Live, runtime: Runtime, text: str, how: str) -> list[dict[int, float]]:
    """Per prompt position after the first: {token id: logprob} as the API gave it (the prompt token first)."""
    body: dict[str, Any] = {"model": runtime.model_name, "prompt": text, "max_tokens": 0, "temperature": 0}
    body.update({"echo": True, "logprobs": K} if how == "echo" else {"prompt_logprobs": K})
    resp = httpx.post(f"{live.url}/v1/completions", json=body, timeout=600)
    assert resp.status_code == 200, resp.text
    choice = resp.json()["choices"][0]
    ids = runtime.local()[1].encode_text(text)
    if how == "prompt_logprobs":
        entries = choice["prompt_logprobs"]
        assert entries[0] is None and len(entries) == len(ids)
        return [{int(t): v["logprob"] for t, v in e.items()} for e in entries[1:]]
    lp = choice["logprobs"]
    assert lp["token_logprobs"][0] is None and len(lp["token_logprobs"]) == len(ids)
    return [{ids[i]: lp["token_logprobs"][i]} for i in range(1, len(ids))]  # alternatives are keyed by text here


def check(got: list[dict[int, float]], ids: list[int], ref: torch.Tensor) -> float:
    """Every returned logprob within TOLERANCE of the reference's; the prompt token's own is always there. Returns
    the largest difference seen."""
    worst = 0.0
    for i, entry in enumerate(got, start=1):
        assert ids[i] in entry, f"position {i}: the prompt token {ids[i]} is missing"
        for tid, value in entry.items():
            want = float(ref[i - 1, tid])
            worst = max(worst, abs(value - want))
            assert abs(value - want) <= TOLERANCE, f"position {i}, token {tid}: {value} vs transformers {want}"
        if len(entry) > 1:  # the top k: none of the reference's top k may be missing beyond a near-tie
            kth = sorted(entry.values())[-K] if len(entry) >= K else min(entry.values())
            assert float(torch.topk(ref[i - 1], K).values[-1]) <= kth + TOLERANCE
    return worst


def decode_streams(live: Live, runtime: Runtime, n: int) -> tuple[list[threading.Thread], list[int]]:
    """n streaming completions, each long (the end-of-turn token biased away); returns their threads and a counter of
    SSE chunks each has read."""
    stops = runtime.local()[1].stop_token_ids
    counts = [0] * n

    def run(i: int) -> None:
        body = {"model": runtime.model_name, "prompt": f"Story {i}: once upon a time", "max_tokens": 400,
                "temperature": 0, "stream": True, "logit_bias": {str(t): -100 for t in stops}}
        with httpx.stream("POST", f"{live.url}/v1/completions", json=body, timeout=600) as resp:
            for line in resp.iter_lines():
                if line.startswith("data: {"):
                    counts[i] += 1
                    json.loads(line[6:])

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    return threads, counts


@pytest.mark.parametrize("how", ["echo", "prompt_logprobs"])
def test_prompt_scores_match_transformers_alone(live: Live, runtime: Runtime, how: str,
                                                references: dict[str, tuple[list[int], torch.Tensor]]) -> None:
    for name, text in TEXTS.items():
        ids, ref = references[name]
        worst = check(score(live, runtime, text, how), ids, ref)
        print(f"{how} {name}: {len(ids)} tokens, max |Δ logprob| {worst:.2e}")


@pytest.mark.parametrize("how", ["echo", "prompt_logprobs"])
def test_prompt_scores_match_transformers_while_eight_streams_decode(
        live: Live, runtime: Runtime, how: str, references: dict[str, tuple[list[int], torch.Tensor]]) -> None:
    threads, counts = decode_streams(live, runtime, 8)
    try:
        while min(counts) < 2:  # every stream is decoding
            assert any(t.is_alive() for t in threads)
            threading.Event().wait(0.05)
        for name, text in TEXTS.items():
            ids, ref = references[name]
            before = list(counts)
            worst = check(score(live, runtime, text, how), ids, ref)
            print(f"{how} {name} beside 8 streams: {len(ids)} tokens, max |Δ logprob| {worst:.2e}")
            assert all(t.is_alive() for t in threads), "a stream ended before the scoring did"
            assert all(c > b for c, b in zip(counts, before, strict=True)), "a stream made no progress meanwhile"
    finally:
        for t in threads:
            t.join(600)


def test_a_reply_scored_is_its_own_heatmap(live: Live) -> None:
    """A greedy reply, then scored on the websocket as the last message of its chat: the same tokens (its text
    re-tokenised) with the same probabilities and ranks as when it was generated."""
    chat = [{"role": "user", "content": "Name three rivers in Europe and say one thing about each."}]
    msgs = ask(live.url, {"type": "generate", "id": "g", "messages": chat, "settings": {"temperature": 0.0},
                          "max_new_tokens": 40, "alternatives": 3})
    reply = "".join(m["text"] for m in msgs if m["type"] == "chunk")
    made = [t for m in msgs if m["type"] == "chunk" for t in m["tokens"]]
    scored = ask(live.url, {"type": "score", "id": "s", "alternatives": 3,
                            "messages": [*chat, {"role": "assistant", "content": reply}]})[-1]["tokens"]
    assert [t["id"] for t in scored] == [t["id"] for t in made] and len(made) == 40
    assert [t["p"] for t in scored] == pytest.approx([t["p"] for t in made], abs=1e-4)
    assert [t["rank"] for t in scored] == [t["rank"] for t in made]
    assert [[a["id"] for a in t["top"]] for t in scored] == [[a["id"] for a in t["top"]] for t in made]
