"""`serve --kv-cache f32|f16|q8_0`: the flag reaches the pools, /api/info says what they store, a format the model
cannot take is a clear error before anything serves, and a pool sized in tokens is estimated in the format's bytes.
(The formats themselves: tests/model/test_kv_format.py.)"""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import torch

from webchat.serve.config import ServerConfig
from webchat.serve.runtime import load_runtime


def test_the_flag_parses_and_names_a_wrong_value(capsys: pytest.CaptureFixture[str]) -> None:
    from webchat.cli.serve import add_arguments, config_from_args

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert config_from_args(parser.parse_args([]), Path("m")).kv_cache is None
    assert config_from_args(parser.parse_args(["--kv-cache", "q8_0"]), Path("m")).kv_cache == "q8_0"
    with pytest.raises(SystemExit):
        parser.parse_args(["--kv-cache", "q4_0"])
    assert "invalid choice: 'q4_0'" in capsys.readouterr().err


def test_the_pools_store_what_the_flag_says(tiny_model_dir: Path) -> None:
    rt = load_runtime(ServerConfig(model_dir=tiny_model_dir, device="cpu", max_seq_len=128, kv_pool="256",
                                   kv_cache="f16"))
    _, _, engine = rt.local()
    assert engine.pool_info()["kv_cache"] == "f16" and engine.pool.k[0].dtype == torch.float16
    gen = rt.new_generator()
    from webchat.engine.sequence import GenerationRequest

    gen.begin_stream(GenerationRequest(prompt_ids=[1, 5, 9, 13], max_new_tokens=4, stop_token_ids=[]))
    made = []
    while True:
        res = gen.stream()
        made += res.token_ids
        if res.eos:
            break
    assert len(made) == 4
    plain = load_runtime(ServerConfig(model_dir=tiny_model_dir, device="cpu", max_seq_len=128, kv_pool="256"))
    assert plain.local()[2].pool_info()["kv_cache"] == "f32"


def test_q8_0_on_heads_that_are_not_whole_blocks_is_refused_by_name(tiny_model_dir: Path) -> None:
    with pytest.raises(ValueError, match="q8_0 needs a head size that is a multiple of 32; this model's is 16"):
        load_runtime(ServerConfig(model_dir=tiny_model_dir, device="cpu", kv_cache="q8_0"))


def test_a_pool_in_tokens_is_estimated_in_the_formats_bytes(tiny_model_dir: Path) -> None:
    from webchat.serve.catalog import scan
    from webchat.serve.models import Models

    cards = scan(tiny_model_dir, tiny_model_dir.parent)
    card = next(iter(cards.values()))
    assert card.kv_per_token

    def pool(kind: str | None) -> int:
        cfg = ServerConfig(model_dir=tiny_model_dir, device="cpu", kv_pool="3000", kv_cache=kind)
        return Models(cards, cfg, None, lambda rt: None).estimate(card)[1]  # type: ignore[arg-type,return-value]

    assert pool(None) == pool("f32") == 3000 * card.kv_per_token
    assert pool("f16") == 3000 * card.kv_per_token // 2
    assert pool("q8_0") == int(3000 * card.kv_per_token * 34 / 128)


def test_a_prompt_past_the_pool_is_told_so_and_the_server_serves_on(tiny_model_dir: Path) -> None:
    """A pool smaller than the model's context (a 3B's default pool holds ~4,700 tokens at float32) is the context a
    client gets: a longer prompt is a 400 `context_length_exceeded` naming the limit, not a 500 from the engine, and the
    next request is served."""
    import httpx
    from live_server import serve  # tests/ is on sys.path under pytest

    config = ServerConfig(model_dir=tiny_model_dir, device="cpu", kv_pool="96")
    rt = load_runtime(config)
    engine = rt.local()[2]
    assert rt.context_length == engine.capacity < 256  # the tiny model's context
    with serve(config, rt) as live:
        name = httpx.get(f"{live.url}/v1/models").json()["data"][0]["id"]
        long = {"role": "user", "content": " ".join(["word"] * 400)}
        bad = httpx.post(f"{live.url}/v1/chat/completions", timeout=60,
                         json={"model": name, "messages": [long], "max_tokens": 4})
        assert bad.status_code == 400 and bad.json()["error"]["code"] == "context_length_exceeded", bad.text
        assert str(engine.capacity) in bad.json()["error"]["message"]
        ok = httpx.post(f"{live.url}/v1/chat/completions", timeout=60,
                        json={"model": name, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4})
        assert ok.status_code == 200, ok.text
