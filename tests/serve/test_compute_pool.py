"""One compute pool (issue 20): a served process loads, warms and steps its model on one thread, so it holds one
torch OpenMP team; a second thread entering torch's parallel regions would start a second team that fights the first
at every barrier. The test records the thread of every load and every forward in a real `webchat serve` app."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from starlette.testclient import TestClient

from webchat.kernels import backend as loader
from webchat.model.transformer import Transformer
from webchat.serve.app import create_app
from webchat.serve.config import ServerConfig


def test_load_warm_up_and_every_forward_run_on_the_device_thread(tiny_model_dir: Path, tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[tuple[str, str]] = []  # (what, thread name)
    forward, load_model = Transformer.forward, loader.load_model

    def recorded_forward(self: Transformer, *args: Any, **kwargs: Any) -> torch.Tensor:
        seen.append(("forward", threading.current_thread().name))
        return forward(self, *args, **kwargs)

    def recorded_load(*args: Any, **kwargs: Any) -> Any:
        seen.append(("load", threading.current_thread().name))
        return load_model(*args, **kwargs)

    monkeypatch.setattr(Transformer, "forward", recorded_forward)
    monkeypatch.setattr(loader, "load_model", recorded_load)
    templates = tmp_path / "templates"
    templates.mkdir()
    (templates / "index.html").write_text("<title>{{ model_name }}</title>")
    config = ServerConfig(model_dir=tiny_model_dir, device="cpu", max_seq_len=256, templates_dir=templates,
                          static_dir=tmp_path)
    with TestClient(create_app(config)) as client:  # the lifespan loads the model
        warm = len(seen)
        with client.websocket_connect("/ws") as ws:
            assert ws.receive_json()["type"] == "hello"
            ws.send_json({"type": "generate", "id": "r", "messages": [{"role": "user", "content": "Hi there"}],
                          "settings": {"temperature": 0}, "max_new_tokens": 6})
            while (msg := ws.receive_json())["type"] != "done":
                assert msg["type"] in ("start", "chunk"), msg
        reply = client.post("/v1/chat/completions", json={"model": tiny_model_dir.name, "max_tokens": 4,
                                                          "messages": [{"role": "user", "content": "Hello"}]})
        assert reply.status_code == 200, reply.text
    kinds = [what for what, _ in seen]
    assert kinds[0] == "load" and "forward" in kinds[1:warm], seen  # loaded, then warmed up, before serving
    assert kinds.count("forward") > warm  # and the requests' forwards were recorded too
    threads = {name for _, name in seen}
    assert threads == {"webchat-device"}, f"model work ran on {sorted(threads)}: {seen}"


def test_a_short_prompt_is_encoded_on_the_event_loop_and_a_long_one_on_a_worker_thread() -> None:
    """Templating a short prompt inline saves the two thread hand-offs (about 1 ms of TTFT); a long one must not stall
    the loop that serves every other connection."""
    import asyncio

    from webchat.serve.encode import INLINE_TEXT_CHARS, encode_text_work, text_chars

    def where(_text: str) -> int:
        return threading.get_ident()

    async def run() -> tuple[int, int, int]:
        short = [{"role": "user", "content": "hi"}]
        long = [{"role": "user", "content": "x" * INLINE_TEXT_CHARS}]
        return (threading.get_ident(), await encode_text_work(where, "hi", chars=text_chars(short)),
                await encode_text_work(where, "x", chars=text_chars(long)))

    loop_thread, short_thread, long_thread = asyncio.run(run())
    assert short_thread == loop_thread
    assert long_thread != loop_thread
    many = [{"role": "user", "content": ""}] * (INLINE_TEXT_CHARS // 32)  # many empty messages still cost templating
    assert text_chars(many) > INLINE_TEXT_CHARS
