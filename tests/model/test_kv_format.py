"""The KV cache's formats (webchat.model.kv_format, `--kv-cache`): q8_0 rows as ggml's block_q8_0 bytes, float16 as
IEEE half, read back as the cache's floats; a pool's size per token; a model whose pools store f16 or q8_0 serving a
prompt again from its cached pages as from a cold cache. (The C++ forward's stores and reads: tests/kernels/
test_cpu_step.py.)"""

from __future__ import annotations

import json
import math
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from bench.tiny import make_tiny_weights, tiny_config
from webchat.engine.engine import Engine
from webchat.engine.generator import Generator
from webchat.engine.sampling import SamplingSettings
from webchat.engine.sequence import GenerationRequest
from webchat.kernels.backend import load_model
from webchat.model import kv_format
from webchat.model.kv_cache import kv_bytes_per_token
from webchat.text.tokenizer import Tokenizer


def ggml_q8_0(x: np.ndarray) -> bytes:
    """quantize_row_q8_0_ref (ggml-quants.c), value by value: per 32, d = amax / 127 as float16 (nearest even), then
    roundf(x * (1 / d)) with the float32 d."""
    out = bytearray()
    for blk in x.astype(np.float32).reshape(-1, 32):
        amax = np.float32(np.max(np.abs(blk)))
        d = np.float32(amax / np.float32(127))
        inv = np.float32(1) / d if d != 0 else np.float32(0)
        out += struct.pack("<e", float(np.float16(d)))
        for v in blk:
            y = float(np.float32(v * inv))
            q = math.floor(abs(y) + 0.5)  # in float64: exact for every float32 y
            out += struct.pack("<b", q if y >= 0 else -q)
    return bytes(out)


def sylvester(n: int = 32) -> np.ndarray:
    """The n-point Walsh-Hadamard matrix in natural order: H[i, j] = (-1)^popcount(i & j)."""
    i = np.arange(n)
    return np.where(np.vectorize(lambda v: bin(v).count("1") % 2)(i[:, None] & i[None, :]) == 1, -1.0, 1.0)


def test_the_transform_is_walsh_hadamards_and_its_own_inverse_over_32() -> None:
    x = torch.randn(7, 32, generator=torch.Generator().manual_seed(3), dtype=torch.float64).float()
    y = kv_format.hadamard(x)
    np.testing.assert_allclose(y.numpy(), x.double().numpy() @ sylvester().T, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(kv_format.hadamard(y) / 32, x, rtol=1e-5, atol=1e-6)
    ints = torch.randint(-100, 100, (3, 32), generator=torch.Generator().manual_seed(4)).float()
    assert torch.equal(kv_format.hadamard(kv_format.hadamard(ints)) / 32, ints)  # integers: exact


def test_q8_0_rows_are_ggml_blocks_of_the_transform_byte_for_byte() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 3, 64, generator=g) * torch.tensor([0.01, 1.0, 300.0]).view(1, 3, 1)
    x[0, 0, :32] = 0.0  # a zero block: d 0, every q 0
    y = torch.arange(32) - 16.0  # y / d lands on halves: roundf takes them away from zero
    y[0] = 127 * 2.0  # d = 2.0 exactly, so -15 / 2 = -7.5 and 1 / 2 = 0.5 are ties
    x[1, 1, :32] = kv_format.hadamard(y) / 32  # integers / 32: the transform gives y back exactly
    x[2, 1, 5] = 20.0  # one channel 20 times the others: spread over its block by the transform
    like = torch.empty(0, dtype=torch.uint8)
    got = kv_format.encode(x, like)
    assert got.shape == (5, 3, 68) and got.dtype == torch.uint8
    turned = kv_format.hadamard(x.reshape(-1, 32))
    assert torch.equal(turned[(1 * 3 + 1) * 2], y)
    want = ggml_q8_0(turned.numpy())
    assert got.numpy().tobytes() == want
    back = kv_format.decode(got, 64)
    # ggml's dequantize_row_q8_0 (q * d in float32), turned back: H (q d) / 32
    blocks = np.frombuffer(want, dtype=np.uint8).reshape(-1, 34)
    d = blocks[:, :2].copy().view(np.float16).astype(np.float32)
    q = blocks[:, 2:].copy().view(np.int8).astype(np.float32)
    assert torch.equal(back.reshape(-1, 32), kv_format.hadamard(torch.from_numpy(q * d)) / 32)
    step = turned.abs().amax(-1, keepdim=True) / 127  # each block's step, in the turned values
    assert ((back.reshape(-1, 32) - x.reshape(-1, 32)).abs() <= step).all()
    # the large channel's block: plain q8_0 (its step set by that channel) errs over twice as much
    plain = np.frombuffer(ggml_q8_0(x[2, 1, :32].numpy()), dtype=np.uint8)
    plain_d = plain[:2].copy().view(np.float16).astype(np.float32)
    plain_back = plain[2:].copy().view(np.int8).astype(np.float32) * plain_d
    err, plain_err = (back[2, 1, :32] - x[2, 1, :32]).abs().max(), np.abs(plain_back - x[2, 1, :32].numpy()).max()
    assert err < plain_err / 2


def test_float16_rows_are_ieee_half_and_f32_rows_are_as_given() -> None:
    x = torch.randn(4, 2, 16, generator=torch.Generator().manual_seed(1)) * 10
    half = kv_format.encode(x, torch.empty(0, dtype=torch.float16))
    assert torch.equal(half, x.half()) and torch.equal(kv_format.decode(half, 16), x.half().float())
    assert torch.equal(kv_format.encode(x, torch.empty(0)), x)


def test_names_and_sizes() -> None:
    with pytest.raises(ValueError, match="--kv-cache must be one of f32, f16, q8_0, got 'q4_0'"):
        kv_format.check("q4_0", 64)
    with pytest.raises(ValueError, match="multiple of 32; this model's is 48"):
        kv_format.check("q8_0", 48)
    assert [kv_format.row_bytes(k, 64) for k in kv_format.KV_CACHE_TYPES] == [256, 128, 68]

    class Args:  # the default model's shape: 30 layers, 3 kv heads of 64
        n_layers, n_kv_heads, head_dim = 30, 3, 64

    f32, f16, q8 = (kv_bytes_per_token(Args, torch.float32, k) for k in kv_format.KV_CACHE_TYPES)  # type: ignore[arg-type]
    assert (f32, f16, q8) == (46080, 23040, 12240)
    assert kv_bytes_per_token(Args, torch.float32) == f32  # type: ignore[arg-type]
    assert q8 / f16 == kv_format.share_of_f32("q8_0") / kv_format.share_of_f32("f16") == 17 / 32


@pytest.fixture(scope="module")
def hd64_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with heads of 64 (q8_0 blocks are 32 values)."""
    out = tmp_path_factory.mktemp("kv-format") / "hd64"
    shutil.copytree(tiny_model_dir, out)
    cfg = json.loads((out / "config.json").read_text())
    shape = dict(hidden_size=128, intermediate_size=256, num_attention_heads=2, num_key_value_heads=1, head_dim=64)
    cfg.update(shape)
    base = tiny_config(cfg["vocab_size"])
    base.update(shape)
    save_file(make_tiny_weights(base, seed=7), str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(cfg))
    return out


@pytest.mark.parametrize("kind", ["f16", "q8_0"])
def test_a_prompt_again_from_cached_pages_gives_the_cold_reply(hd64_dir: Path, kind: str) -> None:
    """The engine on a pool that stores f16 or q8_0: a page copy (the partly filled last page reused) and a registered
    prefix carry the stored bytes, so the same prompt again, and the prompt extended, reply as they do on a cold pool
    of the same format (and the pool says what it holds)."""
    tok = Tokenizer.from_dir(hd64_dir)
    greedy = SamplingSettings(temperature=0.0)
    prompt = torch.randint(3, 500, (45,), generator=torch.Generator().manual_seed(2)).tolist()

    def reply(engine: Engine, ids: list[int]) -> tuple[list[int], int]:
        gen = Generator(engine.model, tok, engine=engine)
        start = gen.begin_stream(GenerationRequest(prompt_ids=ids, settings=greedy, max_new_tokens=12,
                                                   stop_token_ids=[]))
        out: list[int] = []
        while True:
            res = gen.stream()
            out += res.token_ids
            if res.eos:
                return out, start.reused_tokens if start is not None else 0

    def fresh() -> Engine:
        model = load_model(hd64_dir, quantize="q8_0")
        model.kv_cache = kind
        return Engine(model, tok, max_seq_len=256)

    warm = fresh()
    assert warm.pool_info()["kv_cache"] == kind
    first, _ = reply(warm, prompt)
    again, reused = reply(warm, prompt)
    assert reused >= 32 and again == first
    longer = prompt + first[:5]
    extended, reused = reply(warm, longer)
    assert reused >= 45 and extended == reply(fresh(), longer)[0]
    f32 = Engine(load_model(hd64_dir, quantize="q8_0"), tok, max_seq_len=256)
    assert f32.pool_info()["kv_cache"] == "f32"
