"""Several models in one server (webchat.serve.models, issue 22): the catalog in hello and /v1/models, a request
naming its model (loaded on first use, with `loading` messages), least-recently-used unloading past --max-models,
a model over the memory budget refused before loading, an unknown model named, and two models streaming at once."""

from __future__ import annotations

import dataclasses
import json
import shutil
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from live_server import serve  # tests/ is on sys.path under pytest
from websockets.sync.client import connect

from bench.tiny import make_tiny_model
from webchat.serve.config import ServerConfig
from webchat.serve.models import Models, describe, scan
from webchat.serve.runtime import Runtime, load_runtime

pytestmark = pytest.mark.timeout(240)
PROMPT = [{"role": "user", "content": "Tell me about the quick brown fox."}]


@pytest.fixture(scope="module")
def shelf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A models dir: tiny-a (the default), tiny-b (other weights), a .gguf of tiny-b, and a folder that is no model."""
    root = tmp_path_factory.mktemp("models")
    make_tiny_model(root / "tiny-a", seed=0, max_seq_len=256)
    make_tiny_model(root / "tiny-b", seed=1, max_seq_len=256)
    from gguf_write import write_gguf

    write_gguf(root / "tiny-b", root / "tiny-c.gguf", "llama")
    (root / "notes").mkdir()
    (root / "notes" / "readme.txt").write_text("not a model")
    return root


@pytest.fixture(scope="module")
def runtime_a(shelf: Path) -> Runtime:
    return load_runtime(ServerConfig(model_dir=shelf / "tiny-a", device="cpu", max_seq_len=256))


def config(shelf: Path, **extra: Any) -> ServerConfig:
    return ServerConfig(model_dir=shelf / "tiny-a", device="cpu", max_sessions=4, max_queue=4, max_seq_len=256,
                        models_dir=shelf, kv_pool="4MiB", **extra)


def greedy(runtime: Runtime, n: int = 12) -> str:
    from webchat.engine.sequence import GenerationRequest
    from webchat.engine.settings import SamplingSettings

    gen = runtime.new_generator()
    gen.begin_stream(GenerationRequest(prompt_ids=runtime.encode_chat(PROMPT), settings=SamplingSettings(
        temperature=0.0), max_new_tokens=n))
    text = ""
    while not (res := gen.stream()).eos:
        text += res.text
    return text + res.text


def ask(ws_url: str, model: str | None, n: int = 12) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    with connect(ws_url) as ws:
        hello = json.loads(ws.recv(10))
        frame = {"type": "generate", "id": "r", "messages": PROMPT, "settings": {"temperature": 0.0},
                 "max_new_tokens": n, **({"model": model} if model else {})}
        ws.send(json.dumps(frame))
        msgs = []
        while True:
            msg = json.loads(ws.recv(120))
            msgs.append(msg)
            if msg["type"] in ("done", "error"):
                return hello, msgs


def text_of(msgs: list[dict[str, Any]]) -> str:
    return "".join(m["text"] for m in msgs if m["type"] == "chunk")


def test_the_catalog_describes_folders_and_ggufs_without_loading_them(shelf: Path) -> None:
    cards = scan(shelf / "tiny-a", shelf)
    assert list(cards) == ["tiny-a", "tiny-b", "tiny-c"]  # the default first; "notes" is no model
    a, c = cards["tiny-a"], cards["tiny-c"]
    assert a.default and not c.default and a.architecture == "LlamaForCausalLM" and a.weights == "float32"
    assert a.size_bytes == (shelf / "tiny-a" / "model.safetensors").stat().st_size and a.context_length == 256
    assert c.architecture == "llama" and c.weights == "f32" and c.size_bytes == (shelf / "tiny-c.gguf").stat().st_size
    with pytest.raises(ValueError, match="neither a model folder"):
        describe(shelf / "notes")


def test_a_pool_given_in_tokens_is_estimated_from_each_models_shape(shelf: Path, runtime_a: Runtime) -> None:
    from webchat.model.kv_cache import CPU_POOL_BYTES, kv_bytes_per_token

    cards = scan(shelf / "tiny-a", shelf)
    per_token = kv_bytes_per_token(runtime_a.model.args, torch.float32)
    # tiny-b shares tiny-a's shape; its .gguf (tiny-c) states the same shape in GGUF keys
    assert {c.kv_per_token for c in cards.values()} == {per_token}

    def pool(kv_pool: str | None, card: str = "tiny-c") -> int:
        cfg = ServerConfig(model_dir=shelf / "tiny-a", device="cpu", models_dir=shelf, kv_pool=kv_pool)
        models = Models(cards, cfg, None, lambda rt: None)  # type: ignore[arg-type,return-value]  # no loading here
        return models.estimate(cards[card])[1]

    assert pool("3000") == 3000 * per_token and pool("3000", "tiny-a") == 3000 * per_token
    assert pool("4MiB") == 4 << 20 and pool(None) == CPU_POOL_BYTES
    unknown = dataclasses.replace(cards["tiny-b"], kv_per_token=None)  # no shape: the default size, not a guess
    cards["tiny-x"] = unknown
    assert pool("3000", "tiny-x") == CPU_POOL_BYTES


def test_a_request_names_its_model_which_loads_on_first_use(shelf: Path, runtime_a: Runtime) -> None:
    expected_b = greedy(load_runtime(ServerConfig(model_dir=shelf / "tiny-b", device="cpu", max_seq_len=256)))
    with serve(config(shelf), runtime_a) as live:
        hello, msgs = ask(live.ws_url, "tiny-b")
        listed = {m["name"]: m for m in hello["models"]}
        assert hello["model"] == "tiny-a" and listed["tiny-a"]["loaded"] and not listed["tiny-b"]["loaded"]
        assert listed["tiny-b"]["architecture"] == "LlamaForCausalLM" and listed["tiny-c"]["weights"] == "f32"
        kinds = [m["type"] for m in msgs]
        assert kinds[:3] == ["loading", "loading", "start"] and kinds[-1] == "done", kinds
        assert msgs[0]["state"] == "loading" and msgs[0]["model"] == "tiny-b" and msgs[0]["estimate_bytes"] > 0
        assert msgs[1]["state"] == "loaded" and sorted(msgs[1]["loaded"]) == ["tiny-a", "tiny-b"]
        assert text_of(msgs) == expected_b != greedy(runtime_a)
        _, again = ask(live.ws_url, "tiny-b")  # loaded now: no loading messages
        assert [m["type"] for m in again][0] == "start" and text_of(again) == expected_b
        _, default = ask(live.ws_url, None)
        assert text_of(default) == greedy(runtime_a)
        cards = {c["id"]: c for c in httpx.get(f"{live.url}/v1/models").json()["data"]}
        assert set(cards) == {"tiny-a", "tiny-b", "tiny-c"}
        assert cards["tiny-b"]["loaded"] and not cards["tiny-c"]["loaded"]
        body = {"model": "tiny-b", "messages": PROMPT, "max_tokens": 12, "temperature": 0}
        api = httpx.post(f"{live.url}/v1/chat/completions", json=body, timeout=60).json()
        assert api["choices"][0]["message"]["content"] == expected_b and api["model"] == "tiny-b"


def test_unknown_model_is_named_on_both_wires(shelf: Path, runtime_a: Runtime) -> None:
    with serve(config(shelf), runtime_a) as live:
        _, msgs = ask(live.ws_url, "tiny-z")
        assert msgs[-1]["type"] == "error" and msgs[-1]["code"] == "unknown_model"
        assert "'tiny-z' is not served here" in msgs[-1]["message"] and "tiny-b" in msgs[-1]["message"]
        r = httpx.post(f"{live.url}/v1/chat/completions", json={"model": "tiny-z", "messages": PROMPT}, timeout=30)
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
        assert httpx.get(f"{live.url}/v1/models/tiny-z").status_code == 404
        assert httpx.get(f"{live.url}/v1/models/tiny-c").json()["architecture"] == "llama"


def test_past_max_models_the_least_recently_used_idle_model_is_unloaded(shelf: Path, runtime_a: Runtime,
                                                                       tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WEBCHAT_HOME", str(tmp_path))  # the .gguf's converted folder goes there
    with serve(config(shelf, max_models=1), runtime_a) as live:
        _, msgs = ask(live.ws_url, "tiny-b")
        assert msgs[1]["state"] == "loaded" and msgs[1]["loaded"] == ["tiny-b"]  # tiny-a went first
        info = httpx.get(f"{live.url}/api/info").json()
        assert {m["name"]: m["loaded"] for m in info["models"]} == {"tiny-a": False, "tiny-b": True, "tiny-c": False}
        _, back = ask(live.ws_url, "tiny-a")  # loaded again from its folder, same text
        assert back[1]["loaded"] == ["tiny-a"] and text_of(back) == greedy(runtime_a)
        _, gguf = ask(live.ws_url, "tiny-c")  # a .gguf in the dir: converted once, then served
        assert gguf[-1]["type"] == "done" and gguf[1]["loaded"] == ["tiny-c"]


def test_a_model_over_the_memory_budget_is_refused_before_loading(shelf: Path, runtime_a: Runtime) -> None:
    with serve(config(shelf, memory_budget=(4 << 20) + (100 << 10)), runtime_a) as live:  # the KV pool alone: 4 MiB
        _, msgs = ask(live.ws_url, "tiny-b")
        err = msgs[-1]
        assert err["type"] == "error" and err["code"] == "model_too_large", err
        assert "needs about" in err["message"] and "KV pool 4.0 MiB" in err["message"]
        assert "budget is 4.1 MiB" in err["message"] and "was not loaded" in err["message"]
        assert [m["type"] for m in msgs] == ["error"]  # refused before any loading
        info = httpx.get(f"{live.url}/api/info").json()
        assert not {m["name"]: m["loaded"] for m in info["models"]}["tiny-b"]


def test_a_busy_model_is_not_unloaded_and_two_models_stream_at_once(shelf: Path, runtime_a: Runtime) -> None:
    expected_b = greedy(load_runtime(ServerConfig(model_dir=shelf / "tiny-b", device="cpu", max_seq_len=256)), 40)
    expected_a = greedy(runtime_a, 40)
    with serve(config(shelf, max_models=2), runtime_a, delay=0.01) as live:
        results: dict[str, list[dict[str, Any]]] = {}

        def run(model: str) -> None:
            results[model] = ask(live.ws_url, model, 40)[1]

        threads = [threading.Thread(target=run, args=(m,)) for m in ("tiny-a", "tiny-b")]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert text_of(results["tiny-a"]) == expected_a and text_of(results["tiny-b"]) == expected_b
    with serve(config(shelf, max_models=1), runtime_a, delay=0.05) as live, connect(live.ws_url) as ws:
        json.loads(ws.recv(10))
        ws.send(json.dumps({"type": "generate", "id": "long", "messages": PROMPT, "max_new_tokens": 200,
                            "settings": {"temperature": 0.0}}))
        assert json.loads(ws.recv(30))["type"] == "start"
        _, msgs = ask(live.ws_url, "tiny-b")  # tiny-a is streaming: it stays, tiny-b cannot come in
        assert msgs[-1]["type"] == "error" and msgs[-1]["code"] == "model_busy", msgs[-1]
        assert "tiny-a" in msgs[-1]["message"] and "--max-models" in msgs[-1]["message"]
        ws.send(json.dumps({"type": "stop", "id": "long"}))


def test_without_a_models_dir_the_server_serves_its_one_model(shelf: Path, runtime_a: Runtime) -> None:
    one = shutil.copytree(shelf / "tiny-a", shelf.parent / "alone" / "tiny-a")
    cfg = ServerConfig(model_dir=one, device="cpu", max_seq_len=256)
    with serve(cfg, runtime_a) as live:
        hello, msgs = ask(live.ws_url, None)
        assert [m["name"] for m in hello["models"]] == ["tiny-a"] and msgs[-1]["type"] == "done"


# ---------------------------------------------------------------- issue 42, row 4: loads racing for the limits
@pytest.fixture(scope="module")
def five(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("five")
    for seed, name in enumerate("abcde"):
        make_tiny_model(root / f"m-{name}", seed=seed, max_seq_len=256)
    return root


@pytest.mark.parametrize("limit", ["max_models", "memory_budget"])
def test_four_models_racing_never_pass_max_models_or_the_memory_budget(five: Path, limit: str,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Four requests for four models not loaded, at the same moment (the default, m-a, loaded and idle): a load in
    progress counts from the moment it is decided, so the models in memory (loaded or loading, polled every few ms)
    never pass --max-models 1, nor two models' estimates under a budget of 2.5; every request is served or refused
    by name (model_busy). Before, all four loads were decided at once and all four ended loaded."""
    import webchat.serve.runtime as runtime_module

    warm_up = runtime_module.warm_up

    def slow_warm_up(rt: Runtime) -> Runtime:  # each load takes a second more: the polls see it in progress
        time.sleep(1.0)
        return warm_up(rt)

    monkeypatch.setattr(runtime_module, "warm_up", slow_warm_up)
    base = ServerConfig(model_dir=five / "m-a", device="cpu", max_sessions=8, max_queue=8, max_seq_len=256,
                        models_dir=five, kv_pool="4MiB")
    cards = scan(five / "m-a", five)
    one = sum(Models(cards, base, None, lambda rt: None).estimate(cards["m-b"]))  # type: ignore[arg-type,return-value]
    cfg = dataclasses.replace(base, max_models=1) if limit == "max_models" else dataclasses.replace(
        base, max_models=4, memory_budget=one * 5 // 2)
    runtime = load_runtime(dataclasses.replace(base, models_dir=None))
    with serve(cfg, runtime) as live:
        stop, seen, loading = threading.Event(), [], []

        def poll() -> None:
            while not stop.is_set():
                models = httpx.get(f"{live.url}/api/info", timeout=10).json()["models"]
                seen.append([m["name"] for m in models if m["loaded"] or m.get("loading")])
                loading.extend(m["name"] for m in models if m.get("loading"))
                stop.wait(0.005)

        results: dict[str, list[dict[str, Any]]] = {}
        gate = threading.Barrier(4)

        def run(model: str) -> None:
            gate.wait()
            results[model] = ask(live.ws_url, model, 24)[1]

        poller = threading.Thread(target=poll)
        poller.start()
        racers = [threading.Thread(target=run, args=(f"m-{n}",)) for n in "bcde"]
        for t in racers:
            t.start()
        for t in racers:
            t.join(180)
        time.sleep(0.2)
        stop.set()
        poller.join(10)
    most = max(seen, key=len)
    print(f"{limit}: {len(seen)} polls ({len(loading)} during a load), at most {len(most)} in memory ({most}); ends "
          f"{ {m: r[-1].get('code', r[-1]['type']) for m, r in sorted(results.items())} }")
    assert all(len(names) <= (1 if limit == "max_models" else 2) for names in seen), most
    assert loading  # polled while a load was in progress
    ends = [r[-1] for r in results.values()]
    assert len(ends) == 4 and all(e["type"] == "done" or e.get("code") == "model_busy" for e in ends), ends
    assert sum(e["type"] == "done" for e in ends) >= 1
    busy = [e["message"] for e in ends if e["type"] == "error"]
    assert all("cannot be loaded now" in m and "in use" in m for m in busy), busy


def test_a_load_runs_beside_the_streams_and_its_forwards_between_their_steps(shelf: Path, runtime_a: Runtime,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 63, row 8: tiny-b's load is held for two seconds; tiny-a's stream gets tokens meanwhile (on main the
    load ran on the device thread and every stream waited for it). The load ran on the loader thread, the warm-up's
    forwards on the device thread."""
    from webchat.serve import runtime as rt_module

    load, warm = rt_module.load_runtime, rt_module.warm_generation
    where: dict[str, str] = {}
    window: list[float] = []

    def slow_load(config: ServerConfig) -> Runtime:
        where["load"] = threading.current_thread().name
        window.append(time.monotonic())
        time.sleep(2.0)
        out = load(config)
        window.append(time.monotonic())
        return out

    def warm_here(rt: Runtime) -> None:
        where["warm"] = threading.current_thread().name
        warm(rt)

    monkeypatch.setattr(rt_module, "load_runtime", slow_load)
    monkeypatch.setattr(rt_module, "warm_generation", warm_here)
    with serve(config(shelf, max_models=2), runtime_a, delay=0.01) as live, connect(live.ws_url) as ws:
        json.loads(ws.recv(10))
        ws.send(json.dumps({"type": "generate", "id": "long", "messages": PROMPT, "max_new_tokens": 230,
                            "settings": {"temperature": 0.0}}))
        arrived: list[float] = []
        loader = threading.Thread(target=lambda: ask(live.ws_url, "tiny-b", 2))
        loader.start()
        while loader.is_alive() or not window:
            msg = json.loads(ws.recv(30))
            if msg["type"] == "chunk":
                arrived.append(time.monotonic())
            if msg["type"] == "done":
                break
        loader.join(60)
        ws.send(json.dumps({"type": "stop", "id": "long"}))
    assert len(window) == 2, "the load did not run"
    during = [t for t in arrived if window[0] + 0.1 < t < window[1] - 0.1]
    assert len(during) >= 3, f"{len(during)} chunks of tiny-a's stream arrived during tiny-b's load"
    assert where["load"] == "webchat-loader" and where["warm"] == "webchat-device", where


def test_a_client_may_cause_only_so_many_loads_a_minute(shelf: Path, runtime_a: Runtime) -> None:
    """Issue 63, row 8: rotating over three models with --max-models 1 loads one each request; the fifth load within
    LOAD_WINDOW_S is load_limit (429 on the API) naming the loaded models, and a loaded model is still served."""
    from webchat.serve.models import LOADS_PER_WINDOW

    with serve(config(shelf, max_models=1), runtime_a) as live:
        def chat(model: str) -> httpx.Response:
            return httpx.post(f"{live.url}/v1/chat/completions", timeout=60,
                              json={"model": model, "messages": PROMPT, "max_tokens": 2})

        order = ["tiny-b", "tiny-c", "tiny-a", "tiny-b", "tiny-c", "tiny-a"]
        codes = [chat(m).status_code for m in order[:LOADS_PER_WINDOW]]
        assert codes == [200] * LOADS_PER_WINDOW
        refused = chat(order[LOADS_PER_WINDOW])
        assert refused.status_code == 429 and refused.json()["error"]["code"] == "load_limit", refused.text
        assert "models loaded in the last 60 s" in refused.json()["error"]["message"]
        assert chat(order[LOADS_PER_WINDOW - 1]).status_code == 200  # the loaded one: no load, no limit
