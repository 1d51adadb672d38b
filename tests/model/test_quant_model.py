"""Quantized models end to end: loading (folder, --quantize, old folders), the C++ decode step, and fidelity to the
float32 model built from the same dequantized weights (tiny model always; the real default model under real_model)."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from test_fidelity import PROMPTS as FIDELITY  # tests/ is on sys.path under pytest

from webchat.engine.generator import Generator
from webchat.engine.sequence import GenerationRequest
from webchat.engine.settings import SamplingSettings
from webchat.engine.spec.verify_cost import VerifyCost
from webchat.files.folder_check import check_recorded_files
from webchat.gguf.blocks import dequantize, quantize
from webchat.gguf.convert import QUANT_FILE, QUANT_KEY
from webchat.kernels.backend import load_model
from webchat.kernels.cpu import build as qkernels
from webchat.model.loader import weights_name
from webchat.model.quant import QLinear
from webchat.model.transformer import Transformer
from webchat.text.tokenizer import Tokenizer

GREEDY = SamplingSettings(temperature=0.0)


@pytest.fixture(autouse=True, scope="module")
def needs_kernels() -> None:
    try:
        qkernels.load()
    except qkernels.KernelsUnavailable as exc:
        pytest.skip(f"no C++ toolchain here: {exc}")


@pytest.fixture(autouse=True, scope="module")
def one_thread() -> Iterator[None]:
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def dequantized_folder(src: Path, dst: Path, qtype: str) -> Path:
    """src with every matrix quantized to qtype (q8_0 for embedding and head) and back: the float32 twin."""
    shutil.copytree(src, dst)
    with safe_open(str(src / "model.safetensors"), framework="pt") as f:
        ts = {n: f.get_tensor(n) for n in f.keys()}
    for n, t in ts.items():
        if t.dim() == 2:
            kind = qtype if ".layers." in n else "q8_0"
            ts[n] = dequantize(quantize(t, kind), kind)
    save_file(ts, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def greedy(model: Transformer, prompt: list[int], n: int) -> tuple[list[int], torch.Tensor]:
    """n greedy tokens and the (n, vocab) logits they came from; decode steps one token at a time."""
    cache, x, out, rows = model.new_cache(len(prompt) + n), prompt, [], []
    for _ in range(n):
        logits = cache.feed(model, x)[-1]
        rows.append(logits)
        out.append(int(logits.argmax()))
        x = [out[-1]]
    return out, torch.stack(rows)


def prefill(model: Transformer, ids: list[int]) -> torch.Tensor:
    return model.new_cache(len(ids)).feed(model, ids, all_logits=True)


@pytest.mark.parametrize("rows", [1, 8, 40])
@pytest.mark.parametrize("bias", [False, True])
def test_a_prefill_gemm_in_row_tiles_matches_the_dequantized_matrix(monkeypatch: pytest.MonkeyPatch, rows: int,
                                                                   bias: bool) -> None:
    """A matrix larger than one GEMM tile is dequantized and multiplied a tile of rows at a time (here 7 tiles of 3
    rows, the last one short): the same product as the whole dequantized matrix, bias added once."""
    from webchat.model import quant

    torch.manual_seed(0)
    n, k = 20, 64
    w = torch.randn(n, k)
    lin = QLinear(k, n, "q4_1", bias, qkernels.load())
    lin.weight.data.copy_(quantize(w, "q4_1"))
    if lin.bias is not None:
        lin.bias.data.copy_(torch.randn(n))
    x = torch.randn(rows, k)
    ref = torch.nn.functional.linear(x, dequantize(lin.weight.data, "q4_1"), lin.bias)
    whole = lin(x)
    monkeypatch.setattr(quant, "GEMM_MAX_WEIGHTS", 3 * k)
    monkeypatch.setattr(quant, "GEMM_ROWS", 8)
    tiles: list[int] = []
    deq = lin._dequantize
    monkeypatch.setattr(lin, "_dequantize", lambda r: tiles.append(r.shape[0]) or deq(r))
    tiled = lin(x)
    assert tiles == ([3] * 6 + [2] if rows >= 8 else [])  # a matrix-vector kernel below GEMM_ROWS rows
    assert tiled.shape == (rows, n) and tiled.is_contiguous()
    torch.testing.assert_close(tiled, ref, rtol=0, atol=1e-4)
    torch.testing.assert_close(whole, ref, rtol=0, atol=1e-4)


@pytest.mark.parametrize("qtype", ["q8_0", "q4_0"])
def test_quantize_at_load_matches_dequantized_float_model(tiny_model_dir: Path, tmp_path: Path, qtype: str) -> None:
    q = load_model(tiny_model_dir, quantize=qtype, precision="exact")
    f = load_model(dequantized_folder(tiny_model_dir, tmp_path / "f", qtype))
    assert weights_name(q) == qtype and weights_name(f) == "float32"
    assert isinstance(q.layers[0].attention.wq, QLinear)
    prompt = [1, 20, 30, 40, 50, 60]
    full_q, full_f = prefill(q, prompt), prefill(f, prompt)
    assert (full_q - full_f).abs().max().item() <= 1e-4
    (ids_q, rows_q), (ids_f, rows_f) = greedy(q, prompt, 24), greedy(f, prompt, 24)
    assert ids_q == ids_f
    assert (rows_q - rows_f).abs().max().item() <= 1e-4


def test_folder_without_quantized_file_runs_float(tiny_model_dir: Path) -> None:
    assert not (tiny_model_dir / QUANT_FILE).exists()
    assert weights_name(load_model(tiny_model_dir)) == "float32"
    with pytest.raises(ValueError, match="has no quantized.safetensors; quantize at load with --quantize"):
        load_model(tiny_model_dir, weights="quantized")
    with pytest.raises(ValueError, match="quantize must be one of q8_0, q4_1, q4_0, got 'q5_k'"):
        load_model(tiny_model_dir, quantize="q5_k")
    with pytest.raises(ValueError, match="run on the CPU in float32; got device cpu and dtype torch.bfloat16"):
        load_model(tiny_model_dir, dtype=torch.bfloat16, quantize="q8_0")


def test_bfloat16_on_a_quantized_folder_falls_back_to_float(tiny_model_dir: Path, tmp_path: Path) -> None:
    folder = shutil.copytree(tiny_model_dir, tmp_path / "m")
    write_quantized_folder(folder)
    assert weights_name(load_model(folder)) == "q8_0"
    assert weights_name(load_model(folder, dtype=torch.bfloat16)) == "bfloat16"
    assert weights_name(load_model(folder, weights="float32")) == "float32"


def write_quantized_folder(folder: Path) -> None:
    """quantized.safetensors in the documented layout (docs/quant.md), as the converter writes it."""
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        ts = {n: f.get_tensor(n) for n in f.keys()}
    types = {n: "q8_0" for n, t in ts.items() if t.dim() == 2}
    ts.update({n: quantize(ts[n], "q8_0") for n in types})
    save_file(ts, str(folder / QUANT_FILE), metadata={"format": "pt", QUANT_KEY: json.dumps(types)})


# ----------------------------------------------------------------------------------------------- the real model
@pytest.fixture(scope="module")
def real(real_model_dir: Path) -> tuple[Transformer, Transformer, Tokenizer]:
    exact = load_model(real_model_dir, precision="exact")
    return exact, load_model(real_model_dir, weights="float32"), Tokenizer.from_dir(real_model_dir)


@pytest.mark.real_model
def test_real_quantized_file_is_the_gguf_blocks(real_model_dir: Path) -> None:
    with safe_open(str(real_model_dir / QUANT_FILE), framework="pt") as q, \
            safe_open(str(real_model_dir / "model.safetensors"), framework="pt") as f:  # fmt: skip
        types = json.loads(q.metadata()[QUANT_KEY])
        assert types["model.embed_tokens.weight"] == "q8_0"
        assert sum(t == "q4_1" for t in types.values()) == 210
        for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.29.self_attn.k_proj.weight",
                     "model.layers.7.mlp.down_proj.weight", "model.embed_tokens.weight"):  # fmt: skip
            assert torch.equal(dequantize(q.get_tensor(name), types[name]), f.get_tensor(name)), name


@pytest.mark.real_model
@pytest.mark.parametrize("idx", range(len(FIDELITY)))
def test_real_quantized_matches_float32_on_fidelity_prompts(real: tuple[Any, Any, Tokenizer], idx: int) -> None:
    q, f, tok = real
    assert weights_name(q) == "q4_1"
    ids = tok.encode(tok.apply_chat_template(FIDELITY[idx], add_generation_prompt=True))
    full = (prefill(q, ids) - prefill(f, ids)).abs().max()
    assert full.item() <= 1e-3, f"prefill max |Δlogit| {full.item():.2e}"
    (ids_q, rows_q), (ids_f, rows_f) = greedy(q, ids, 32), greedy(f, ids, 32)
    first = next((i for i, (a, b) in enumerate(zip(ids_q, ids_f, strict=True)) if a != b), None)
    assert ids_q == ids_f, f"first difference at token {first}"
    assert (rows_q - rows_f).abs().max().item() <= 1e-3


@pytest.mark.real_model
@pytest.mark.parametrize("mode", ["self", "ngram", "draft", "auto"])
def test_real_quantized_greedy_identical_in_every_speculative_mode(real: tuple[Any, Any, Tokenizer], mode: str) -> None:
    q, f, tok = real
    text = "Fix the typo and repeat it: 'The quick brown fox jumps ovre the lazy dog near the river bank.'"
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": text}]))

    def run(model: Any, spec: str, draft: Any = None) -> list[int]:
        gen = Generator(model, tok, max_seq_len=256, draft_model=draft)
        gen.engine.auto.cost = VerifyCost.flat()  # auto: every draft it is offered granted
        gen.begin_stream(GenerationRequest(prompt_ids=prompt, stop_token_ids=[], settings=GREEDY, max_new_tokens=24,
                                           speculative=spec))
        out: list[int] = []
        while True:
            res = gen.stream()
            out += res.token_ids
            if res.eos:
                return out

    assert run(q, mode, draft=q if mode == "draft" else None) == run(f, "none")


@pytest.mark.real_model
def test_pull_adds_the_quantized_file_to_an_older_folder(real_model_dir: Path, tmp_path: Path) -> None:
    from webchat.files import pull
    from webchat.files.home import default_gguf_path, default_model_dir

    home = tmp_path / "home"
    old = default_model_dir(home)
    old.mkdir(parents=True)
    for p in real_model_dir.iterdir():  # what a pull before quantized weights left: everything but QUANT_FILE
        if p.name != QUANT_FILE:
            os.link(p, old / p.name)
    default_gguf_path(home).parent.mkdir(parents=True)
    os.link(default_gguf_path(), default_gguf_path(home))
    assert pull.ensure_default_model(home) == old
    assert (old / QUANT_FILE).is_file() and weights_name(load_model(old)) == "q4_1"
    check_recorded_files(real_model_dir)  # the marker linked from it was replaced in `old`, not written through


@pytest.mark.real_model
def test_a_default_folder_that_no_longer_matches_its_record_is_converted_again(real_model_dir: Path,
                                                                               tmp_path: Path) -> None:
    from webchat.files import pull
    from webchat.files.home import default_gguf_path, default_model_dir

    home = tmp_path / "home"
    folder = default_model_dir(home)
    folder.mkdir(parents=True)
    for p in real_model_dir.iterdir():
        os.link(p, folder / p.name)
    default_gguf_path(home).parent.mkdir(parents=True)
    os.link(default_gguf_path(), default_gguf_path(home))
    marker = json.loads((folder / ".complete").read_text())
    marker["files"][QUANT_FILE]["head_sha256"] = "0" * 64  # what a damaged record or file looks like
    (folder / ".complete").unlink()
    (folder / ".complete").write_text(json.dumps(marker))
    assert not pull.is_complete(folder)
    assert pull.ensure_default_model(home) == folder
    check_recorded_files(folder)  # converted again: the new record matches the new files
    assert pull.is_complete(folder) and weights_name(load_model(folder)) == "q4_1"
    check_recorded_files(real_model_dir)
