"""Q4_K, Q5_K and Q6_K: our test encoder (tests/kquant_encode.py) checked against gguf.quants' decoder, webchat's own
decoder (webchat.model.quant.dequantize_k) identical to it, and a GGUF of K-quant matrices run by path."""

from __future__ import annotations

import io
import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf_write import F32, write_gguf
from kquant_encode import encode_q4_k, encode_q5_k, encode_q6_k
from safetensors import safe_open
from safetensors.numpy import load_file

from webchat.files.gguf_cache import model_folder
from webchat.gguf.blocks import dequantize_k
from webchat.gguf.convert import QUANT_FILE, QUANT_KEY, hf_tensor_name
from webchat.kernels.backend import load_model
from webchat.kernels.cpu import build as qkernels
from webchat.model.quant import QEmbedding, QLinear

Q = gguf.GGMLQuantizationType
FORMATS = {"q4_k": (encode_q4_k, Q.Q4_K, 144, 15), "q5_k": (encode_q5_k, Q.Q5_K, 176, 31),
           "q6_k": (encode_q6_k, Q.Q6_K, 210, 63)}


def rows() -> np.ndarray:
    """Random rows of different spreads and signs, plus the edge cases: zeros, a constant, all negative, one spike."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((12, 512)).astype(np.float32) * rng.uniform(0.01, 10, (12, 1)).astype(np.float32)
    x[0] = 0.0
    x[1] = 0.75
    x[2] = -np.abs(x[2])
    x[3, :] = 0.0
    x[3, 100] = 40.0
    return x


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_encoder_is_a_valid_encoding(fmt: str) -> None:
    encode, kind, nbytes, levels = FORMATS[fmt]
    x = rows()
    blocks = encode(x)
    assert blocks.dtype == np.uint8 and blocks.shape == (12, 512 // 256 * nbytes)
    y = gguf.quants.dequantize(blocks, kind)
    # within a fraction of each block's step (its range over the levels) plus the 6/8-bit scale rounding
    block_range = np.abs(x.reshape(12, 2, 256)).max(-1, keepdims=True) * 2
    err = np.abs(y - x).reshape(12, 2, 256)
    assert (err <= block_range / levels + 1e-6).all(), f"{fmt}: max error {err.max():.3g}"
    assert np.array_equal(y[0], x[0]) and np.allclose(y[1], 0.75, atol=0.75 / levels)


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_webchat_decoder_equals_gguf(fmt: str) -> None:
    encode, kind, _, _ = FORMATS[fmt]
    blocks = encode(rows())
    got = dequantize_k(torch.from_numpy(blocks), fmt).numpy()
    assert np.array_equal(got, gguf.quants.dequantize(blocks, kind))


def test_decoder_refuses_bad_blocks() -> None:
    with pytest.raises(ValueError, match="q3_k"):
        dequantize_k(torch.zeros(1, 144, dtype=torch.uint8), "q3_k")
    with pytest.raises(ValueError, match=r"multiple|rows, k \* 210"):
        dequantize_k(torch.zeros(1, 144, dtype=torch.uint8), "q6_k")


def test_a_q4_k_m_style_gguf_runs_by_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Q4_K matrices, Q6_K for v, down and the embedding (as llama.cpp's Q4_K_M mixes them), float32 norms: the
    blocks kept as they are and run by the C++ K-quant kernels, the float copy exactly as gguf.quants decodes them,
    and the model within 1e-4 of transformers on those weights."""
    transformers = pytest.importorskip("transformers", reason="transformers (for the tiny model) is not installed")
    from test_gguf_cache import PROMPT, greedy_logits, tiny_folder

    qkernels.try_load()
    monkeypatch.setenv("WEBCHAT_HOME", str(tmp_path / "home"))
    assert transformers is not None
    reference = tiny_folder("qwen3", tmp_path / "hf", hidden=256, ffn=512)

    def mix(name: str, w: np.ndarray) -> Q:
        if w.ndim == 1:
            return F32
        if w.shape[1] % 256:  # o_proj's 64 columns: llama.cpp falls back to a 32-block type likewise
            return Q.Q8_0
        return Q.Q6_K if any(p in name for p in ("v_proj", "down_proj", "embed_tokens")) else Q.Q4_K

    path = tmp_path / "tiny-Q4_K_M.gguf"
    write_gguf(tmp_path / "hf", path, "qwen3", qtype=mix)
    folder = model_folder(path, out=io.StringIO())
    floats = load_file(str(folder / "model.safetensors"))
    kinds = {t.tensor_type for t in gguf.GGUFReader(path).tensors}
    assert {Q.Q4_K, Q.Q6_K} <= kinds
    for t in gguf.GGUFReader(path).tensors:
        if t.tensor_type in (Q.Q4_K, Q.Q6_K):
            name = hf_tensor_name(t.name)
            assert np.array_equal(floats[name], gguf.quants.dequantize(t.data, t.tensor_type)), t.name
    # the model on those weights, against transformers given the same dequantized weights
    with torch.no_grad():
        for name, p in reference.named_parameters():
            p.copy_(torch.from_numpy(floats[name]))
    with safe_open(str(folder / QUANT_FILE), framework="pt") as f:  # the K-quant blocks kept as they are
        kept = json.loads((f.metadata() or {})[QUANT_KEY])
        down = f.get_tensor("model.layers.1.mlp.down_proj.weight")
    assert kept["model.layers.1.mlp.down_proj.weight"] == "q6_k" and kept["model.layers.1.mlp.up_proj.weight"] == "q4_k"
    blocks = next(t for t in gguf.GGUFReader(path).tensors if t.name == "blk.1.ffn_down.weight")
    assert torch.equal(down, torch.from_numpy(np.array(blocks.data)))
    model = load_model(folder, precision="exact")
    assert {m.qtype for m in model.modules() if isinstance(m, QLinear | QEmbedding)} == {"q4_k", "q6_k", "q8_0"}
    step = model.runner
    assert step is not None  # the C++ forward runs the K-quant matrices (and Qwen3's q/k norms) itself
    mod = qkernels.load()
    # the C++ forward on every path this CPU runs, then the PyTorch path, QLinear's K-quant kernels matrix by matrix
    runs = [(step, path) for path in qkernels.PATHS.values() if path <= mod.best_path()]
    try:
        for runner, path in [*runs, (None, -1)]:
            model.runner = runner
            mod.set_path(path)
            ids, got = greedy_logits(model, PROMPT)
            with torch.no_grad():
                want = reference(torch.tensor([ids[:-1]])).logits[0]
            assert (got - want).abs().max().item() <= 1e-4, (runner, path)
            assert want[len(PROMPT) - 1 :].argmax(-1).tolist() == ids[len(PROMPT) :]
    finally:
        mod.set_path(-1)
    assert step.calls > 0 and len(runs) >= 1


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("m", [1, 3, 17])
def test_cpp_matmul_against_the_dequantized_weights(kernels: object, fmt: str, m: int) -> None:
    encode, kind, _, _ = FORMATS[fmt]
    w = torch.from_numpy(encode(rows()))
    dense = dequantize_k(w, fmt)  # (12, 512)
    x, bias = torch.randn(m, 512, generator=torch.Generator().manual_seed(m)), torch.randn(12)
    want = x @ dense.T + bias
    best = kernels.best_path()  # type: ignore[attr-defined]
    try:
        for path in range(best + 1):  # every path this CPU runs: scalar, AVX2, AVX-512
            assert kernels.set_path(path) == path  # type: ignore[attr-defined]
            # the blocks' floats, bit for bit, on every path (the prompt rows' GEMM dequantizes its tiles with them)
            assert torch.equal(torch.ops.webchat_kq.dequantize(w, int(kind), 512), dense), f"path {path}"
            got = torch.ops.webchat_kq.matmul(x, w, int(kind), 512, bias)
            # the C++ forward's rows (qmatmul_multi → kq_rows: q4k_rows_r on AVX2, q4k_rows_avx512, 4 x rows at a time)
            step_rows = kernels.qmatmul(x, w, int(kind), 512, bias)  # type: ignore[attr-defined]
            # ... and its prompt rows (qgemm_multi: the matrix dequantized by tiles, each output one chain over k)
            prompt_rows = kernels.qmatmul(x, w, int(kind), 512, bias, gemm=True)  # type: ignore[attr-defined]
            for out in (got, step_rows, prompt_rows):
                assert out.shape == (m, 12)
                delta = (out - want).abs().max().item()
                assert torch.allclose(out, want, rtol=1e-5, atol=1e-4), f"path {path}: max |Δ| {delta:.2e}"
    finally:
        kernels.set_path(-1)  # type: ignore[attr-defined]


def test_cpp_kernels_refuse_bad_input(kernels: object) -> None:
    w = torch.from_numpy(encode_q4_k(rows()))
    with pytest.raises(RuntimeError, match=r"qtype must be 12 \(Q4_K\), 13 \(Q5_K\) or 14 \(Q6_K\), got 2"):
        torch.ops.webchat_kq.matmul(torch.zeros(1, 512), w, 2, 512, None)
    with pytest.raises(RuntimeError, match="w rows must hold 420 bytes"):
        torch.ops.webchat_kq.matmul(torch.zeros(1, 512), w, 14, 512, None)
    with pytest.raises(RuntimeError, match=r"x must be \(M, 512\)"):
        torch.ops.webchat_kq.matmul(torch.zeros(1, 256), w, 12, 512, None)


def test_a_big_ggufs_block_matrices_are_written_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Past convert.FLOAT_FILE_LIMIT (an 8B file's float32 is 32 GB) model.safetensors leaves the block matrices to
    quantized.safetensors, written a tensor at a time: the float path decodes them at load to the very floats a whole
    float file holds, and the quantized path is the same model."""
    pytest.importorskip("transformers", reason="transformers (for the tiny model) is not installed")
    from test_gguf_cache import tiny_folder

    import webchat.gguf.convert as convert

    tiny_folder("llama", tmp_path / "hf", hidden=256, ffn=512)
    path = tmp_path / "tiny.gguf"
    write_gguf(tmp_path / "hf", path, "llama",
               qtype=lambda name, w: F32 if w.ndim == 1 else Q.Q6_K if "down_proj" in name else Q.Q4_0)
    whole = tmp_path / "whole"
    convert.convert_gguf(path, whole)
    monkeypatch.setattr(convert, "FLOAT_FILE_LIMIT", 0)
    split = tmp_path / "split"
    convert.convert_gguf(path, split)
    with safe_open(str(split / "model.safetensors"), framework="pt") as f:
        assert f.metadata()[convert.FLOATS_IN_BLOCKS_KEY] == QUANT_FILE
        floats = set(f.keys())
    with safe_open(str(split / QUANT_FILE), framework="pt") as f:
        kept = json.loads((f.metadata() or {})[QUANT_KEY])
    assert kept and not floats & set(kept) and "model.norm.weight" in floats
    assert (split / "model.safetensors").stat().st_size < (whole / "model.safetensors").stat().st_size / 4
    assert (split / QUANT_FILE).read_bytes() == (whole / QUANT_FILE).read_bytes()
    for weights in ("float32", "auto"):
        a, b = load_model(whole, weights=weights), load_model(split, weights=weights)
        sa, sb = a.state_dict(), b.state_dict()
        assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa), weights
