"""`--model FILE.gguf`: converted once into $WEBCHAT_HOME/gguf-models/<stem>-<key>/, Q4_0/Q4_1/Q8_0 blocks kept as
they are, other types dequantized, exact to transformers; the GGUFs are written by gguf's GGUFWriter from tiny
random models (tests/gguf_write.py)."""

from __future__ import annotations

import argparse
import io
import json
import re
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from gguf_write import F32, write_gguf
from safetensors import safe_open
from test_archs import ragged_greedy

from bench.tiny import CHATML_TEMPLATE, make_tiny_tokenizer
from webchat.cli.main import cli
from webchat.files.gguf_cache import gguf_models_dir, model_folder, model_name
from webchat.gguf.convert import QUANT_FILE, QUANT_KEY, ConversionError
from webchat.kernels.backend import load_model
from webchat.kernels.cpu import build as qkernels
from webchat.model.transformer import Transformer

transformers = pytest.importorskip("transformers", reason="transformers (the reference) is not installed")

Q = gguf.GGMLQuantizationType
DECODE = 16
CONFIGS = {"llama": "LlamaConfig", "qwen2": "Qwen2Config", "qwen3": "Qwen3Config"}


def tiny_folder(arch: str, folder: Path, hidden: int = 64, ffn: int = 96, **extra: Any) -> Any:
    """A random transformers model of `arch` with webchat's tiny tokenizer, saved as a folder; the model back."""
    tok = make_tiny_tokenizer()
    torch.manual_seed(0)
    config = getattr(transformers, CONFIGS[arch])(
        vocab_size=tok.get_vocab_size(), hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
        bos_token_id=1, eos_token_id=2, initializer_range=0.2, tie_word_embeddings=arch == "qwen2", **extra)
    model = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.3)
    model.save_pretrained(folder)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHATML_TEMPLATE,
                                                               "eos_token": "<|im_end|>"}))
    return model


def mixed(name: str, w: np.ndarray) -> Q:
    """Each kept 32-value block format, a dequantized-once format (F16) and float32 norms in one file."""
    if w.ndim == 1:
        return F32
    for part, kind in (("q_proj", Q.Q4_0), ("k_proj", Q.Q4_1), ("v_proj", Q.F16), ("o_proj", Q.Q5_0)):
        if part in name:
            return kind
    return Q.Q8_0


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    qkernels.try_load()  # the C++ kernels from the real cache, before $WEBCHAT_HOME moves
    monkeypatch.setenv("WEBCHAT_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def greedy_logits(model: Transformer, ids: list[int]) -> tuple[list[int], torch.Tensor]:
    """Our logits at every position of the prompt and DECODE greedy tokens (the last one's logits left out)."""
    ids = list(ids)
    cache = model.new_cache(len(ids) + DECODE)
    rows = [cache.feed(model, ids, all_logits=True)]
    for _ in range(DECODE):
        ids.append(int(rows[-1][-1].argmax()))
        rows.append(cache.feed(model, ids[-1:]))
    return ids, torch.cat(rows[:-1])


PROMPT = [5, 40, 77, 300, 12, 9, 120, 451, 33]


@pytest.mark.parametrize("arch", list(CONFIGS))
def test_float_gguf_runs_exact_to_transformers(tmp_path: Path, home: Path, arch: str) -> None:
    reference = tiny_folder(arch, tmp_path / "hf")
    write_gguf(tmp_path / "hf", tmp_path / f"tiny-{arch}.gguf", arch)
    folder = model_folder(tmp_path / f"tiny-{arch}.gguf", out=io.StringIO())
    assert folder.parent == gguf_models_dir(home) and re.fullmatch(rf"tiny-{arch}-[0-9a-f]{{16}}", folder.name)
    model = load_model(folder)
    ids, got = greedy_logits(model, PROMPT)
    with torch.no_grad():
        want = reference(torch.tensor([ids[:-1]])).logits[0]
    assert (got - want).abs().max().item() <= 1e-4
    assert want[len(PROMPT) - 1 :].argmax(-1).tolist() == ids[len(PROMPT) :]
    seqs = [PROMPT[:4], PROMPT[2:]]  # batched: two prompts of different lengths in one ragged batch
    n_prompt = [len(s) for s in seqs]
    for seq, logits, n in zip(seqs, ragged_greedy(model, seqs, DECODE), n_prompt, strict=True):
        with torch.no_grad():
            want = reference(torch.tensor([seq[:-1]])).logits[0]
        assert (logits - want).abs().max().item() <= 1e-4
        assert want[n - 1 :].argmax(-1).tolist() == seq[n:]


def test_llama3_rope_scaling_from_rope_freqs(tmp_path: Path, home: Path) -> None:
    """Llama 3.x GGUFs carry their rope scaling as rope_freqs.weight; the folder's config gets it back."""
    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    reference = tiny_folder("llama", tmp_path / "hf", rope_parameters=rope)
    write_gguf(tmp_path / "hf", tmp_path / "llama3.gguf", "llama")
    assert "rope_freqs.weight" in [t.name for t in gguf.GGUFReader(tmp_path / "llama3.gguf").tensors]
    folder = model_folder(tmp_path / "llama3.gguf", out=io.StringIO())
    scaling = json.loads((folder / "config.json").read_text())["rope_scaling"]
    assert {k: scaling[k] for k in rope if k != "rope_theta"} == {k: v for k, v in rope.items() if k != "rope_theta"}
    ids, got = greedy_logits(load_model(folder), PROMPT)
    with torch.no_grad():
        want = reference(torch.tensor([ids[:-1]])).logits[0]
    assert (got - want).abs().max().item() <= 1e-4
    assert want[len(PROMPT) - 1 :].argmax(-1).tolist() == ids[len(PROMPT) :]


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_blocks_kept_as_they_are_and_match_their_dequantized_weights(tmp_path: Path, home: Path, arch: str) -> None:
    tiny_folder(arch, tmp_path / "hf")
    path = tmp_path / "mixed.gguf"
    write_gguf(tmp_path / "hf", path, arch, qtype=mixed)
    folder = model_folder(path, out=io.StringIO())
    with safe_open(str(folder / QUANT_FILE), framework="pt") as f:
        kept = json.loads((f.metadata() or {})[QUANT_KEY])
        q0 = f.get_tensor("model.layers.1.self_attn.v_proj.weight")
        raw = f.get_tensor("model.layers.1.mlp.down_proj.weight")
    assert {kept[f"model.layers.1.{n}.weight"] for n in ("self_attn.q_proj", "self_attn.k_proj", "mlp.up_proj")} \
        == {"q4_0", "q4_1", "q8_0"}
    assert "model.layers.1.self_attn.v_proj.weight" not in kept
    assert kept["model.layers.1.self_attn.o_proj.weight"] == "q5_0"
    assert q0.dtype == torch.float32  # F16 dequantized once
    blocks = next(t for t in gguf.GGUFReader(path).tensors if t.name == "blk.1.ffn_down.weight")
    assert torch.equal(raw, torch.from_numpy(np.array(blocks.data)))  # the file's bytes, unchanged
    quantized, floats = load_model(folder, precision="exact"), load_model(folder, weights="float32")
    assert {type(m).__name__ for m in quantized.modules()} >= {"QLinear", "QEmbedding"}
    ids, got = greedy_logits(quantized, PROMPT)
    _, want = greedy_logits(floats, PROMPT)
    assert (got - want).abs().max().item() <= 1e-3


def test_converted_once_then_reused_keyed_by_content(tmp_path: Path, home: Path) -> None:
    tiny_folder("qwen3", tmp_path / "hf")
    path = tmp_path / "m.gguf"
    write_gguf(tmp_path / "hf", path, "qwen3")
    first_out, second_out = io.StringIO(), io.StringIO()
    first = model_folder(path, out=first_out)
    assert "hashing m.gguf: 100%" in first_out.getvalue() and "converting m.gguf" in first_out.getvalue()
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    assert model_folder(path, out=second_out) == first and second_out.getvalue() == ""  # no hashing, no conversion
    assert (first / "model.safetensors").stat().st_mtime_ns == stamp
    assert [p.name for p in gguf_models_dir(home).iterdir() if p.name.startswith(".")] == []  # no temp folder left
    write_gguf(tmp_path / "hf", path, "qwen3", qtype=lambda n, w: Q.Q8_0 if w.ndim == 2 else F32)
    assert model_folder(path, out=io.StringIO()) != first  # new content, new key
    assert model_name(first) == "m" and model_name(tmp_path / "hf") == "hf"  # a folder of one's own keeps its name
    assert model_name(gguf_models_dir(home) / "m-notakey") == "m-notakey"


def test_cli_complete_and_serve_take_a_gguf(tmp_path: Path, home: Path, capsys: pytest.CaptureFixture[str]) -> None:
    tiny_folder("llama", tmp_path / "hf")
    path = tmp_path / "tiny.gguf"
    write_gguf(tmp_path / "hf", path, "llama", qtype=mixed)
    assert cli(["complete", "hello", "--model", str(path), "--max-new-tokens", "4"]) == 0
    err = capsys.readouterr().err
    assert "converting tiny.gguf (once)" in err and "4 tokens" in err
    from starlette.testclient import TestClient

    seen: dict[str, Any] = {}

    def run(app: Any, **kwargs: Any) -> None:
        with TestClient(app, base_url="http://127.0.0.1:8000") as client:
            response = client.get("/v1/models")
            assert response.status_code == 200, response.text
            seen["models"] = response.json()

    from webchat.cli.serve import add_arguments, main

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert main(parser.parse_args(["--model", str(path)]), run=run) == 0
    assert seen["models"]["data"][0]["id"] == "tiny"  # the file's name, as in --models-dir, not its cache key


def test_a_file_webchat_cannot_read_is_named_in_one_line(tmp_path: Path, home: Path,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf file at all" * 10)
    assert cli(["complete", "hi", "--model", str(junk)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert "junk.gguf: not a GGUF file" in err[-1]
    w = gguf.GGUFWriter(str(tmp_path / "g.gguf"), arch="rwkv6")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ConversionError, match="architecture 'rwkv6' is not supported"):
        model_folder(tmp_path / "g.gguf", out=io.StringIO())


def test_an_unreadable_ggml_type_is_named(tmp_path: Path, home: Path) -> None:
    tiny_folder("qwen3", tmp_path / "hf")
    path = tmp_path / "q81.gguf"
    write_gguf(tmp_path / "hf", path, "qwen3")
    reader = gguf.GGUFReader(path)
    names = [t.name for t in reader.tensors]
    # rewrite with one matrix typed Q8_1 (40-byte blocks of 32), which gguf.quants cannot dequantize
    w = gguf.GGUFWriter(str(tmp_path / "bad.gguf"), arch="qwen3")
    for field in reader.fields.values():
        if field.name.startswith(("qwen3.", "tokenizer.")):
            w.add_key_value(field.name, field.contents(), field.types[0],
                            field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None)
    for t in reader.tensors:
        data = np.asarray(t.data)
        if t.name == "blk.0.ffn_up.weight":
            rows, cols = data.shape
            w.add_tensor(t.name, np.zeros((rows, cols // 32 * 40), np.uint8), raw_dtype=Q.Q8_1)
        else:
            w.add_tensor(t.name, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    assert "blk.0.ffn_up.weight" in names
    with pytest.raises(ConversionError, match="'blk.0.ffn_up.weight' is of ggml type Q8_1"):
        model_folder(tmp_path / "bad.gguf", out=io.StringIO())


def test_a_gguf_served_by_path_and_found_in_the_models_dir_is_one_model_named_by_its_file(tmp_path: Path,
                                                                                        home: Path) -> None:
    from webchat.serve.models import scan

    tiny_folder("llama", tmp_path / "hf")
    shelf = tmp_path / "shelf"
    shelf.mkdir()
    write_gguf(tmp_path / "hf", shelf / "tiny.gguf", "llama")
    cards = scan(model_folder(shelf / "tiny.gguf", out=io.StringIO()), shelf)
    assert list(cards) == ["tiny"] and cards["tiny"].default  # listed once, under the file's name
