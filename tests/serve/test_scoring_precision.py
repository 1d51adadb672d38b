"""Prompt scores are exact by construction (issue 64, docs/quant.md "Scores are exact"): on the real default model a
default server (int8x2 on a vector path) and one forced to int8 give the same `echo` logprobs, `prompt_logprobs` and
websocket scores as an `--exact` server, within 1e-4, however long the text; their generated tokens still come from
their own precision."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import pytest
from live_server import Live, serve  # tests/ is on sys.path under pytest
from test_scoring_real import TEXTS
from test_scoring_ws import ask

from webchat.kernels.cpu import build as qkernels
from webchat.model.precision import set_precision
from webchat.serve.config import ServerConfig
from webchat.serve.runtime import Runtime, load_runtime

pytestmark = [pytest.mark.real_model, pytest.mark.timeout(900)]
TOLERANCE = 1e-4
K = 3
SERVERS = ("exact", "default", "int8")


@pytest.fixture(scope="module")
def servers(real_model_dir: Path) -> Iterator[dict[str, tuple[Live, Runtime]]]:
    """An --exact server, a default one and one whose model is forced to int8, on the default model."""
    if qkernels.try_load() is None or qkernels.available_paths()[-1] not in ("avx2", "avx512"):
        pytest.skip("no vector path here: every precision is exact")
    out: dict[str, tuple[Live, Runtime]] = {}
    with ExitStack() as stack:
        for name in SERVERS:
            config = ServerConfig(model_dir=real_model_dir, device="cpu", max_seq_len=2048, exact=name == "exact")
            rt = load_runtime(config)
            if name == "int8":
                assert rt.model is not None
                rt = replace(rt, precision=set_precision(rt.model, "int8", qkernels.try_load()))
            out[name] = (stack.enter_context(serve(config, rt)), rt)
        yield out


def complete(live: Live, rt: Runtime, body: dict[str, Any]) -> dict[str, Any]:
    resp = httpx.post(f"{live.url}/v1/completions", json={"model": rt.model_name, "temperature": 0, **body},
                      timeout=600)
    assert resp.status_code == 200, resp.text
    choice: dict[str, Any] = resp.json()["choices"][0]
    return choice


def test_the_servers_run_their_precisions(servers: dict[str, tuple[Live, Runtime]]) -> None:
    info = {name: httpx.get(f"{live.url}/api/info", timeout=30).json()["precision"]
            for name, (live, _) in servers.items()}
    assert info == {"exact": "exact", "default": "int8x2", "int8": "int8"}


@pytest.mark.parametrize("text", list(TEXTS))
def test_echo_logprobs_are_the_exact_servers(servers: dict[str, tuple[Live, Runtime]], text: str) -> None:
    """`echo` + `logprobs` (lm-eval's loglikelihood): every prompt token's logprob and its top K alternatives."""
    got = {name: complete(live, rt, {"prompt": TEXTS[text], "max_tokens": 0, "echo": True, "logprobs": K})["logprobs"]
           for name, (live, rt) in servers.items()}
    want = got["exact"]
    for name in ("default", "int8"):
        assert got[name]["tokens"] == want["tokens"]
        pairs = list(zip(got[name]["token_logprobs"][1:], want["token_logprobs"][1:], strict=True))
        worst = max(abs(a - b) for a, b in pairs)
        assert worst <= TOLERANCE, f"{name}: echo logprobs {worst:.2e} from --exact's"
        for a, b in zip(got[name]["top_logprobs"][1:], want["top_logprobs"][1:], strict=True):
            common = a.keys() & b.keys()  # a near-tie at the K-th place may swap which one is listed
            assert len(common) >= K - 1 and all(abs(a[t] - b[t]) <= TOLERANCE for t in common)


def test_prompt_logprobs_and_a_generation_after_them(servers: dict[str, tuple[Live, Runtime]]) -> None:
    """vLLM's `prompt_logprobs` with tokens generated after them: the prompt's scores are exact, the reply is
    generated (at the server's own precision)."""
    got = {name: complete(live, rt, {"prompt": TEXTS["english"], "max_tokens": 8, "prompt_logprobs": K})
           for name, (live, rt) in servers.items()}
    want = got["exact"]["prompt_logprobs"]
    for name in ("default", "int8"):
        entries = got[name]["prompt_logprobs"]
        assert entries[0] is None and len(entries) == len(want)
        for a, b in zip(entries[1:], want[1:], strict=True):
            common = a.keys() & b.keys()
            assert common and all(abs(a[t]["logprob"] - b[t]["logprob"]) <= TOLERANCE for t in common)
        assert got[name]["text"]


def test_a_websocket_score_is_the_exact_servers(servers: dict[str, tuple[Live, Runtime]]) -> None:
    """The page's Score (and Score with…, the same request on another model)."""
    frame = {"type": "score", "id": "s", "text": TEXTS["code"], "alternatives": K}
    got = {name: ask(live.url, frame)[-1]["tokens"] for name, (live, _) in servers.items()}
    for name in ("default", "int8"):
        assert [t["id"] for t in got[name]] == [t["id"] for t in got["exact"]]
        worst = max(abs(a["p"] - b["p"]) for a, b in zip(got[name][1:], got["exact"][1:], strict=True))
        assert worst <= TOLERANCE, f"{name}: scores {worst:.2e} from --exact's"
