"""Admission is fair and bounded whatever limits it (issue 23), and every request reuses the cache to the token
(issue 20): a real uvicorn on the tiny model, its engine seen through tests/live_server.Probe."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from live_server import serve  # tests/ is on sys.path under pytest
from websockets.sync.client import connect as sync_connect

from webchat.serve.config import ServerConfig
from webchat.serve.runtime import Runtime, load_runtime
from webchat.serve.worker import PER_CLIENT

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def config(tiny_model_dir: Path) -> ServerConfig:
    return ServerConfig(model_dir=tiny_model_dir, device="cpu", max_sessions=4, max_queue=6, max_seq_len=256,
                        kv_pool="512")  # 32 pages of 16: four long replies fill it, so pages, not slots, bind


@pytest.fixture(scope="module")
def runtime(config: ServerConfig) -> Runtime:
    return load_runtime(config)


def body(runtime: Runtime, text: str, **extra: Any) -> dict[str, Any]:
    return {"model": runtime.model_name, "messages": [{"role": "user", "content": text}], "temperature": 0, **extra}


def test_a_repeated_prompt_through_the_api_reuses_all_of_it(config: ServerConfig, runtime: Runtime) -> None:
    with serve(config, runtime) as live:
        runtime.engine.reset()
        text = "A prompt of some forty tokens, said twice: the second time its kept logits give the first token."
        replies = []
        for _ in range(2):
            reply = httpx.post(f"{live.url}/v1/chat/completions", json=body(runtime, text, max_tokens=3), timeout=60)
            assert reply.status_code == 200, reply.text
            replies.append(reply.json()["choices"][0]["message"]["content"])
        assert replies[0] == replies[1]
        (_, ids, first), (_, again, second) = live.probe.started[-2:]
        assert ids == again and len(ids) > 32 and len(ids) % 16  # a partial last page
        assert first.reused_tokens < 16  # cold (the template's opening may be cached from warm-up)
        assert second.reused_tokens == len(ids)  # whole pages and the partial last page's tokens, all of them
        longer = httpx.post(f"{live.url}/v1/chat/completions", timeout=60,
                            json=body(runtime, text + " And then it goes on.", max_tokens=3))
        assert longer.status_code == 200
        (_, ext, info) = live.probe.started[-1]
        common = next(i for i, (a, b) in enumerate(zip(ids, ext, strict=False)) if a != b)
        assert info.reused_tokens >= common  # an extended prompt computes only what is new


def test_a_flood_from_one_client_neither_overflows_the_queue_nor_starves_a_newcomer(config: ServerConfig,
                                                                                     runtime: Runtime) -> None:
    eos = runtime.tokenizer.stop_token_ids
    flood = body(runtime, "Count to a thousand.", max_tokens=220, stream=True,
                 logit_bias={str(t): -100 for t in eos})
    statuses: list[int] = []
    with serve(config, runtime, delay=0.002) as live:
        runtime.engine.reset()
        queued_seen: list[int] = []
        stop = threading.Event()

        def watch() -> None:
            while not stop.is_set():
                try:
                    queued_seen.append(httpx.get(f"{live.url}/healthz", timeout=10).json()["queued"])
                except httpx.HTTPError:
                    return
                time.sleep(0.01)

        def one() -> None:
            with httpx.stream("POST", f"{live.url}/v1/chat/completions", json=flood, timeout=240) as r:
                statuses.append(r.status_code)
                for _ in r.iter_lines():
                    pass

        watcher = threading.Thread(target=watch)
        watcher.start()
        threads = [threading.Thread(target=one) for _ in range(40)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 60
        while len(statuses) < 30 and time.monotonic() < deadline:
            time.sleep(0.02)
        # one client (this host) holds at most the 4 slots and 4 waiting places: the rest is refused at once
        assert statuses.count(429) >= 30 - config.max_sessions - PER_CLIENT, statuses
        with sync_connect(live.ws_url) as ws:  # a newcomer: its own connection, its own client
            assert json.loads(ws.recv(10))["type"] == "hello"
            ws.send(json.dumps({"type": "generate", "id": "n", "max_new_tokens": 4, "settings": {"temperature": 0},
                                "messages": [{"role": "user", "content": "Hi!"}]}))
            msg = json.loads(ws.recv(240))
            admitted_before = len(live.probe.started)  # once queued, the next admission must be this one
            while msg["type"] != "start":
                assert msg["type"] == "queued", msg
                msg = json.loads(ws.recv(240))
            while json.loads(ws.recv(60))["type"] != "done":
                pass
        newcomer = next(i for i, (_, ids, _) in enumerate(live.probe.started) if i >= admitted_before
                        and runtime.tokenizer.decode(ids).count("Hi!"))
        order = [(step, "Hi!" in runtime.tokenizer.decode(ids)) for step, ids, _ in live.probe.started]
        assert newcomer == admitted_before, (order, admitted_before)  # the first free slot went to the newcomer
        stop.set()
        watcher.join()
        for t in threads:
            t.join()
    assert max(queued_seen) <= PER_CLIENT + 1 < config.max_queue, max(queued_seen)  # the flood's share + the newcomer
    assert sorted(set(statuses)) == [200, 429]
