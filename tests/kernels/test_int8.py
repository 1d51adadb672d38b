"""int8 activations (docs/quant.md, "Two precisions"): the kernels on every path against the scalar path bit for bit
(the integer sums are exact and every path takes the float steps in one order) and against float64 on the activations
as they are quantized (a Python copy of the rounding); every row's numbers its own, alone or beside others; the
precision a model runs at, by default and asked for, and where the server says it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from kquant_encode import encode_q4_k, encode_q5_k, encode_q6_k

from webchat.gguf.blocks import K_QTYPES, QTYPES, dequantize, dequantize_k, quantize
from webchat.kernels.backend import load_model
from webchat.kernels.cpu import build as qkernels
from webchat.model.precision import QuantFormats, default_precision, quantized_formats
from webchat.model.quant import QLinear
from webchat.serve.config import ServerConfig
from webchat.serve.runtime import load_runtime

F32 = np.float32
ENCODERS = {"q4_k": encode_q4_k, "q5_k": encode_q5_k, "q6_k": encode_q6_k}
# (M activation rows, N output rows, K): one block, odd counts, a tail group of fewer than 8 blocks, long rows
SHAPES = [(1, 1, 32), (3, 7, 96), (5, 33, 160), (9, 40, 1536), (17, 19, 2080)]
K_SHAPES = [(1, 1, 256), (3, 7, 512), (9, 33, 768), (17, 12, 2048)]


@pytest.fixture(params=["scalar", "avx2", "avx2+vnni", "avx2+avxvnni", "avx512", "avx512+vnni"])
def path(request: pytest.FixtureRequest, kernels: Any) -> Iterator[str]:
    """Every code path, and the int8 kernels' vpdpbusd forms where the CPU has VNNI (+vnni: AVX-512 VNNI's where it
    has them, else AVX-VNNI's; +avxvnni: AVX-VNNI's, which a CPU with both runs only when told); the others skipped by
    name."""
    name = str(request.param)
    base, _, vnni = name.partition("+")
    if base not in qkernels.available_paths():
        pytest.skip(f"this CPU cannot run the {base} path (it runs {qkernels.available_paths()})")
    if vnni == "avxvnni":
        try:
            kernels.set_vnni(2)
        except RuntimeError:
            pytest.skip("this CPU has no AVX-VNNI: its vpdpbusd forms are not run here")
    elif vnni:
        try:
            kernels.set_vnni(1)
        except RuntimeError:
            pytest.skip("this CPU has neither AVX-VNNI nor AVX-512 VNNI: the vpdpbusd kernels are not run here")
    else:
        kernels.set_vnni(0)
    kernels.set_path(qkernels.PATHS[base])
    yield name
    kernels.set_path(-1)
    kernels.set_vnni(-1)


def weights(qtype: str, n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(blocks, their float64 values) of a random (n, k) matrix."""
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed))
    if qtype in K_QTYPES:
        blocks = torch.from_numpy(ENCODERS[qtype](w.numpy()))
        return blocks, dequantize_k(blocks, qtype).double()
    blocks = quantize(w, qtype)
    return blocks, dequantize(blocks, qtype).double()


def qtype_number(qtype: str) -> int:
    return {**QTYPES, **K_QTYPES}[qtype][0]


def act_blocks(x: np.ndarray) -> np.ndarray:
    """The 32-value formats' activations as the kernels see them (float64): a scale per 8 values, a / 127 with
    a = max |x|, q = round(x * (127 / a)) half to even, every step in float32 as the C++ takes it."""
    xb = x.astype(F32).reshape(x.shape[0], -1, 8)
    a = np.abs(xb).max(-1, keepdims=True)
    d = a / F32(127)
    inv = np.where(a > 0, F32(127) / np.where(a > 0, a, F32(1)), F32(0)).astype(F32)
    q = np.rint(xb * inv)
    return (q.astype(np.float64) * d.astype(np.float64)).reshape(x.shape)


def act_supers(x: np.ndarray) -> np.ndarray:
    """The K-quants' activations: per 256 one scale A / 127 / 128, per 32 a power of two 2^(7 - e), e <= 7 the largest
    with a_j 2^e <= A; q = round((x 2^e) * (127 / A))."""
    xs = x.astype(F32).reshape(x.shape[0], -1, 8, 32)
    a = np.abs(xs).max(-1)
    top = a.max(-1, keepdims=True)
    e = np.zeros_like(a)
    for _ in range(7):
        e = np.where((e < 7) & (a * (F32(2) ** (e + 1)) <= top), e + 1, e)
    inv = np.where(top > 0, F32(127) / np.where(top > 0, top, F32(1)), F32(0)).astype(F32)
    q = np.rint((xs * (F32(2) ** e)[..., None]) * inv[..., None])
    dk = top / F32(127) / F32(128)
    value = q.astype(np.float64) * (dk.astype(np.float64) * 2.0 ** (7 - e))[..., None]
    return value.reshape(x.shape)


def reference(x: torch.Tensor, wd: torch.Tensor, qtype: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(x as quantized @ W^T in float64, the sum of |products| per output: the scale of float32's rounding)."""
    xq = torch.from_numpy(act_supers(x.numpy()) if qtype in K_QTYPES else act_blocks(x.numpy()))
    return xq @ wd.T, xq.abs() @ wd.abs().T


def check_close(got: torch.Tensor, x: torch.Tensor, wd: torch.Tensor, qtype: str) -> None:
    want, scale = reference(x, wd, qtype)
    # float32 steps after the exact integer sums: a rounding of at most 2^-24 of the running sum per block (the scale
    # product, the fma) and a few for the final lane sum
    steps = 3 * (x.shape[1] // 32) + 8
    bad = (got.double() - want).abs() > steps * 2.0**-24 * scale + 1e-30
    assert not bad.any(), f"{qtype}: {int(bad.sum())} outputs off, max |err| {(got.double() - want).abs().max():.3g}"


@pytest.mark.parametrize("gemm", [False, True], ids=["rows", "prompt"])
@pytest.mark.parametrize("qtype", list(QTYPES))
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_32_value_formats_on_every_path(kernels: Any, path: str, qtype: str, shape: tuple[int, int, int],
                                        gemm: bool) -> None:
    m, n, k = shape
    wq, wd = weights(qtype, n, k, seed=m + n + k)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(k))
    got = kernels.qmatmul(x, wq, qtype_number(qtype), k, gemm=gemm, int8=True)
    check_close(got, x, wd, qtype)
    kernels.set_path(0)  # the scalar path's bits, on whichever path the fixture chose
    assert torch.equal(got, kernels.qmatmul(x, wq, qtype_number(qtype), k, gemm=gemm, int8=True)), path


@pytest.mark.parametrize("gemm", [False, True], ids=["rows", "prompt"])
@pytest.mark.parametrize("qtype", list(K_QTYPES))
@pytest.mark.parametrize("shape", K_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_k_quants_on_every_path(kernels: Any, path: str, qtype: str, shape: tuple[int, int, int], gemm: bool) -> None:
    """The row kernels and the prompt GEMM (x rows 8 to a group, a last group short)."""
    m, n, k = shape
    wq, wd = weights(qtype, n, k, seed=m + n + k)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(k)) * torch.linspace(0.01, 3, k)  # uneven blocks
    got = kernels.qmatmul(x, wq, qtype_number(qtype), k, gemm=gemm, int8=True)
    check_close(got, x, wd, qtype)
    kernels.set_path(0)
    assert torch.equal(got, kernels.qmatmul(x, wq, qtype_number(qtype), k, gemm=gemm, int8=True)), path


@pytest.mark.parametrize("gemm", [False, True], ids=["rows", "prompt"])
@pytest.mark.parametrize("qtype", ["q4_0", "q4_1", "q5_0", "q8_0", "q4_k", "q5_k", "q6_k"])
def test_a_rows_result_does_not_depend_on_the_rows_beside_it(kernels: Any, path: str, qtype: str,
                                                             gemm: bool) -> None:
    """Bit for bit: row i of an m-row call equals row i alone, for every group size the kernels take rows in (the
    row kernels' 1 to 4, the GEMM's groups of 8 and a short last one)."""
    k = 512
    wq, _ = weights(qtype, 37, k, seed=3)
    x = torch.randn(19, k, generator=torch.Generator().manual_seed(4))
    qt = qtype_number(qtype)
    alone = torch.cat([kernels.qmatmul(x[i : i + 1], wq, qt, k, gemm=gemm, int8=True) for i in range(19)])
    for m in (2, 3, 5, 8, 9, 16, 19):
        assert torch.equal(kernels.qmatmul(x[:m], wq, qt, k, gemm=gemm, int8=True), alone[:m]), f"{path} m={m}"
        tail = kernels.qmatmul(x[m:], wq, qt, k, gemm=gemm, int8=True) if m < 19 else alone[:0]
        assert torch.equal(tail, alone[m:]), f"{path}: rows from {m}"


PACKED = ["q4_0", "q4_1", "q8_0", "q4_k", "q5_k", "q6_k"]
# (M, N, K) with N whole groups of 8 rows: one group, a tail of blocks past a multiple of 8, long rows
PACKED_SHAPES = {"q4_0": [(1, 8, 32), (3, 16, 96), (5, 40, 160), (9, 40, 1536), (17, 24, 2080)],
                 "q4_1": [(1, 8, 32), (3, 16, 96), (5, 40, 160), (9, 40, 1536), (17, 24, 2080)],
                 "q8_0": [(1, 8, 32), (3, 16, 96), (5, 40, 160), (9, 40, 1536), (17, 24, 2080)],
                 "q4_k": [(1, 8, 256), (3, 16, 512), (9, 40, 768), (17, 16, 2048)],
                 "q5_k": [(1, 8, 256), (3, 16, 512), (9, 40, 768), (17, 16, 2048)],
                 "q6_k": [(1, 8, 256), (3, 16, 512), (9, 40, 768), (17, 16, 2048)]}


def packed(kernels: Any, wq: torch.Tensor, qtype: str) -> torch.Tensor:
    out = wq.clone()
    kernels.repack8(out, qtype_number(qtype), True)
    return out


@pytest.mark.parametrize("gemm", [False, True], ids=["rows", "prompt"])
@pytest.mark.parametrize("case", [(q, s) for q in PACKED for s in PACKED_SHAPES[q]],
                         ids=lambda c: f"{c[0]}-{'x'.join(map(str, c[1]))}")
def test_packed_rows_on_every_path(kernels: Any, path: str, case: tuple[str, tuple[int, int, int]],
                                   gemm: bool) -> None:
    """Weight rows packed 8 to a group (qpack8.cpp): against float64 on the activations as quantized, the scalar path
    bit for bit, and each x row's numbers its own in a call of any size (the kernels take 1 to 4 at a time)."""
    qtype, (m, n, k) = case
    wq, wd = weights(qtype, n, k, seed=m + n + k)
    wp, qt = packed(kernels, wq, qtype), qtype_number(qtype)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(k)) * torch.linspace(0.01, 3, k)
    got = kernels.qmatmul(x, wp, qt, k, gemm=gemm, int8=True, packed=True)
    check_close(got, x, wd, qtype)
    alone = torch.cat([kernels.qmatmul(x[i : i + 1], wp, qt, k, gemm=gemm, int8=True, packed=True) for i in range(m)])
    assert torch.equal(got, alone), path
    kernels.set_path(0)
    assert torch.equal(got, kernels.qmatmul(x, wp, qt, k, gemm=gemm, int8=True, packed=True)), path


@pytest.mark.parametrize("m", [1, 7, 13, 40])
def test_packed_q4_k_prompt_rows_give_the_decode_rows_bits(kernels: Any, path: str, m: int) -> None:
    """A prompt's rows against packed Q4_K take a GEMM: with VNNI tiles of vpdpbusd (qpack8_gemm.inc: up to 6 x rows
    by 2 groups of 8 weight rows), without it qgemm8.cpp's panel of 8 x rows (4 weight rows a pass), on the scalar
    path its reference loop. Each sums in q4k_scalar's order, so on every path they give the bits the packed row
    kernels give decode rows (whole tiles, a tile's leftover rows and a lone last group: 40 rows, 5 groups), and the
    same bits with VNNI or without."""
    k, n = 768, 40
    wq, wd = weights("q4_k", n, k, seed=m)
    wp, qt = packed(kernels, wq, "q4_k"), qtype_number("q4_k")
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)) * torch.linspace(0.01, 3, k)
    prompt = kernels.qmatmul(x, wp, qt, k, gemm=True, int8=True, packed=True)
    check_close(prompt, x, wd, "q4_k")
    assert torch.equal(prompt, kernels.qmatmul(x, wp, qt, k, gemm=False, int8=True, packed=True)), path
    kernels.set_path(0)
    kernels.set_vnni(0)
    assert torch.equal(prompt, kernels.qmatmul(x, wp, qt, k, gemm=True, int8=True, packed=True)), path


@pytest.mark.parametrize("case", [("q4_k", False), ("q5_k", False), ("q4_k", True)],
                         ids=lambda c: f"{c[0]}{'-packed' if c[1] else ''}")
def test_k_quant_prompt_mins_at_their_bounds(kernels: Any, path: str, case: tuple[str, bool]) -> None:
    """The prompt GEMM without VNNI sums the mins as int16 pairs (qgemm8.cpp: mn_j p_j and sum_j q): at their largest,
    every scale and min 63 and sub-blocks of x all +-1 (sum_j q = +-4064 at p_j = 128), the scalar path's bits and the
    decode rows' (packed), close to float64."""
    qtype, pack = case
    n, k, m = 16, 512, 9
    wq, _ = weights(qtype, n, k, seed=7)
    wq = wq.clone()
    wq.view(n, k // 256, K_QTYPES[qtype][1])[:, :, 4:16] = 255  # every 6-bit scale and min 63
    wd = dequantize_k(wq, qtype).double()
    qt = qtype_number(qtype)
    w = packed(kernels, wq, qtype) if pack else wq
    signs = torch.where(torch.arange(k // 32) // 2 % 2 == 0, 1.0, -1.0).repeat_interleave(32)  # by pair of sub-blocks
    x = signs.repeat(m, 1) * torch.linspace(1.0, 2.0, m)[:, None]
    got = kernels.qmatmul(x, w, qt, k, gemm=True, int8=True, packed=pack)
    check_close(got, x, wd, qtype)
    if pack:
        assert torch.equal(got, kernels.qmatmul(x, w, qt, k, gemm=False, int8=True, packed=True)), path
    kernels.set_path(0)
    kernels.set_vnni(0)
    assert torch.equal(got, kernels.qmatmul(x, w, qt, k, gemm=True, int8=True, packed=pack)), path


@pytest.mark.parametrize("m", [1, 13, 40])
def test_q8_0_prompt_rows_are_their_own_however_grouped(kernels: Any, path: str, m: int) -> None:
    """A prompt's Q8_0 rows take qgemm8b.cpp's GEMM, 8 rows a vector (vpdpbusd where VNNI is in use, the sign trick's
    vpmaddubsw + vpmaddwd otherwise): each row's sums its own (the same bits alone, in a call of any size, a group's
    missing rows included), close to float64 on the quantized activations, and the scalar path's bits, with VNNI or
    without. Weights of -128 (|w| = 128 in vpmaddubsw, the pair's bound) included."""
    k, n = 320, 21
    wq, wd = weights("q8_0", n, k, seed=m)
    wq = wq.clone()
    wq[0, 2:34] = torch.tensor([128] * 16 + [127] * 16, dtype=torch.uint8)  # -128 and 127 against x's extremes
    wd = wd.clone()
    wd[0, :32] = dequantize(wq[:1, :34], "q8_0").double()[0]
    qt = qtype_number("q8_0")
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)) * torch.linspace(0.01, 3, k)
    x[:, :32] = torch.where(torch.arange(32) < 16, -1.0, 1.0)  # q = -127 and 127: every pair at its largest
    got = kernels.qmatmul(x, wq, qt, k, gemm=True, int8=True)
    check_close(got, x, wd, "q8_0")
    alone = torch.cat([kernels.qmatmul(x[i : i + 1], wq, qt, k, gemm=True, int8=True) for i in range(m)])
    assert torch.equal(got, alone), path
    kernels.set_path(0)
    assert torch.equal(got, kernels.qmatmul(x, wq, qt, k, gemm=True, int8=True)), path


@pytest.mark.parametrize("case", [("q4_0", 1000, False), ("q4_1", 1024, True), ("q8_0", 1032, True)],
                         ids=lambda c: f"{c[0]}-{c[1]}{'-packed' if c[2] else ''}")
def test_a_large_call_in_chunks_computes_each_row_once(kernels: Any, case: tuple[str, int, bool]) -> None:
    """A call of more than a few chunks' weights (qact.cpp, CHUNK_BYTES) goes in chunks each thread takes from its own
    run and then from the others': every row once, the bits of the one-thread call (an even split), packed groups kept
    whole where the chunk edges fall inside them."""
    qtype, n, pack = case
    k = 2048
    wq, wd = weights(qtype, n, k, seed=n)
    qt = qtype_number(qtype)
    w = packed(kernels, wq, qtype) if pack else wq
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(n))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = kernels.qmatmul(x, w, qt, k, int8=True, packed=pack)
        torch.set_num_threads(max(threads, 2))
        got = kernels.qmatmul(x, w, qt, k, int8=True, packed=pack)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(got, alone)
    check_close(got, x, wd, qtype)


@pytest.mark.parametrize("m", [1, 4, 13])
def test_packed_q8_0_rows_give_the_prompt_gemm_bits(kernels: Any, path: str, m: int) -> None:
    """Packed Q8_0 (a lane a weight row: the sign trick without VNNI, w + 128 and 128 sum q taken back with it) sums
    in qgemm8b.cpp's order, so decode rows, verify rows and a prompt's rows against it all give the bits of the
    unpacked matrix's prompt GEMM; weights of -128 and 127 against x at +-127 included."""
    k, n = 320, 24
    wq, _ = weights("q8_0", n, k, seed=m)
    wq = wq.clone()
    wq[0, 2:34] = torch.tensor([128] * 16 + [127] * 16, dtype=torch.uint8)  # -128 and 127
    wq[9, 36:68] = torch.tensor([128] * 32, dtype=torch.uint8)
    qt = qtype_number("q8_0")
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)) * torch.linspace(0.01, 3, k)
    x[:, :32] = torch.where(torch.arange(32) < 16, -1.0, 1.0)
    want = kernels.qmatmul(x, wq, qt, k, gemm=True, int8=True)
    wp = packed(kernels, wq, "q8_0")
    for gemm in (False, True):
        assert torch.equal(kernels.qmatmul(x, wp, qt, k, gemm=gemm, int8=True, packed=True), want), (path, gemm)
    alone = torch.cat([kernels.qmatmul(x[i : i + 1], wp, qt, k, int8=True, packed=True) for i in range(m)])
    assert torch.equal(alone, want), path


def check_packed_gives_the_prompt_gemm_bits(kernels: Any, path: str, wq: torch.Tensor, qtype: str, m: int) -> None:
    """The (n, k) blocks wq packed: decode rows, verify rows and a prompt's rows give the unpacked matrix's prompt GEMM
    bits (close to float64 on the activations as quantized), each row alone too, and the scalar path's without VNNI;
    x's first super-block one value a row (q = 127, p = 128: the bounds the callers set up against). Past 32 rows a
    prompt's rows take the GEMM, which decodes the packed units itself."""
    k = wq.shape[1] // K_QTYPES[qtype][1] * 256
    wd = dequantize_k(wq, qtype).double()
    qt = qtype_number(qtype)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)) * torch.linspace(0.01, 3, k)
    x[:, :256] = torch.linspace(1.0, 2.0, m)[:, None]
    want = kernels.qmatmul(x, wq, qt, k, gemm=True, int8=True)
    check_close(want, x, wd, qtype)
    wp = packed(kernels, wq, qtype)
    for gemm in (False, True):
        assert torch.equal(kernels.qmatmul(x, wp, qt, k, gemm=gemm, int8=True, packed=True), want), (path, gemm)
    alone = torch.cat([kernels.qmatmul(x[i : i + 1], wp, qt, k, int8=True, packed=True) for i in range(m)])
    assert torch.equal(alone, want), path
    kernels.set_path(0)
    kernels.set_vnni(0)
    assert torch.equal(kernels.qmatmul(x, wp, qt, k, int8=True, packed=True), want), path


@pytest.mark.parametrize("m", [1, 2, 4, 13, 40])
def test_packed_q6_k_rows_give_the_prompt_gemm_bits(kernels: Any, path: str, m: int) -> None:
    """Packed Q6_K (a lane a weight row; q unsigned, 32 sum x taken back per group of 16: vpdpbusd's start, or the
    vpmaddubsw pairs' int16 sums) sums in the unpacked matrix's prompt GEMM order, one fma a sub-block, so decode rows,
    verify rows and a prompt's rows (which gather the packed rows back) give its bits. At the int32 bound: scales of
    -128 and q of 0 (w = -32) against a super-block of x all at 127 with p = 128 (2,130,706,432 a sub-block)."""
    k, n = 512, 24
    wq, _ = weights("q6_k", n, k, seed=m)
    wq = wq.clone()
    blocks = wq.view(n, k // 256, 210)
    blocks[:2, 0, :192] = 0  # every q 0: w = -32
    blocks[:2, 0, 192:208] = 128  # every scale -128
    check_packed_gives_the_prompt_gemm_bits(kernels, path, wq, "q6_k", m)


@pytest.mark.parametrize("m", [1, 2, 4, 13, 40])
def test_packed_q5_k_rows_give_the_prompt_gemm_bits(kernels: Any, path: str, m: int) -> None:
    """Packed Q5_K (Q4_K's packed nibbles with qh's words beside them, a lane a weight row) sums in the unpacked
    matrix's prompt GEMM order, one fma a sub-block and the mins' after, so decode rows, verify rows and a prompt's
    rows (which gather the packed rows back) give its bits. At the bounds: every q 31, every scale and min 63, against
    a super-block of x all at 127 with p = 128 (vpmaddubsw's four words of pairs: 4 * 2 * 31 * 127 = 31,496)."""
    k, n = 512, 24
    wq, _ = weights("q5_k", n, k, seed=m)
    wq = wq.clone()
    wq.view(n, k // 256, 176)[:2, 0, 4:] = 255  # scales and mins 63, qh and qs all ones: q = 31
    check_packed_gives_the_prompt_gemm_bits(kernels, path, wq, "q5_k", m)


def test_packing_moves_bytes_and_gives_them_back(kernels: Any) -> None:
    """Packing is a permutation of each group's bytes, in place; unpacking restores the file's bytes. A format or a
    row count without the packed form is refused by name, and so is reading packed rows without int8."""
    for qtype in PACKED:
        k = 512
        wq, _ = weights(qtype, 24, k, seed=5)
        wp = packed(kernels, wq, qtype)
        assert not torch.equal(wp, wq) and wp.shape == wq.shape
        for g in range(3):  # each group keeps its own bytes
            rows = slice(8 * g, 8 * g + 8)
            assert torch.equal(wp[rows].flatten().sort().values, wq[rows].flatten().sort().values)
        kernels.repack8(wp, qtype_number(qtype), False)
        assert torch.equal(wp, wq), qtype
    q50, _ = weights("q5_0", 8, 64, seed=0)
    with pytest.raises(RuntimeError, match="has no packed form"):
        kernels.repack8(q50.clone(), qtype_number("q5_0"), True)
    q41, _ = weights("q4_1", 12, 64, seed=0)
    with pytest.raises(RuntimeError, match="with 12 rows has no packed form"):
        kernels.repack8(q41.clone(), qtype_number("q4_1"), True)
    with pytest.raises(RuntimeError, match="packed rows are read by the int8 kernels"):
        kernels.qmatmul(torch.randn(1, 64), q41[:8].contiguous(), qtype_number("q4_1"), 64, packed=True)


def test_a_tied_head_packs_and_the_lookup_gathers_its_rows(kernels: Any, tiny_model_dir: Path,
                                                          tmp_path: Path) -> None:
    """A tied head (SmolLM2's) packs with the embedding's table at int8: the lookup, in PyTorch and in the C++
    forward, gathers each row back, so the embeddings are the file's and the logits those of the unpacked table but
    for the head's summation order; "exact" puts the file's bytes back."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file
    from test_quant_model import prefill

    from webchat.model.precision import set_precision

    tied_dir = tmp_path / "tied"
    shutil.copytree(tiny_model_dir, tied_dir)
    cfg = json.loads((tied_dir / "config.json").read_text())
    (tied_dir / "config.json").write_text(json.dumps({**cfg, "tie_word_embeddings": True}))
    weights = load_file(str(tied_dir / "model.safetensors"))
    del weights["lm_head.weight"]
    save_file(weights, str(tied_dir / "model.safetensors"), metadata={"format": "pt"})
    ids = list(range(3, 20))
    model = load_model(tied_dir, quantize="q4_1", precision="exact")
    assert model.output.weight is model.tok_embeddings.weight and model.output.qtype == "q8_0"
    table = model.output.weight.clone()
    looked_up = model.tok_embeddings(torch.tensor([ids]))
    set_precision(model, "int8", kernels, pack=False)
    unpacked = prefill(model, ids)
    set_precision(model, "int8", kernels)
    assert model.output.packed and model.tok_embeddings.packed and not torch.equal(model.output.weight, table)
    assert torch.equal(model.tok_embeddings(torch.tensor([ids])), looked_up)
    with pytest.raises(RuntimeError, match="out of range"):  # a hostile id names itself, packed or not
        model.tok_embeddings(torch.tensor([[model.args.vocab_size]]))
    got = prefill(model, ids)
    assert model.runner is not None and model.runner.calls > 0  # the C++ forward ran it
    assert (got - unpacked).abs().max() < 1e-4 * unpacked.abs().max(), (got - unpacked).abs().max()
    set_precision(model, "exact", kernels)
    assert not model.tok_embeddings.packed and torch.equal(model.output.weight, table)


def test_a_model_packs_at_int8_and_unpacks_at_exact(kernels: Any, tiny_model_dir: Path) -> None:
    """set_precision packs the matrices that have the form, and "exact" gives the file's bytes back: the exact
    forward's logits are those of a model never packed."""
    from test_quant_model import prefill

    from webchat.model.precision import set_precision

    model = load_model(tiny_model_dir, quantize="q4_1", precision="exact")
    before = {name: m.weight.clone() for name, m in model.named_modules() if isinstance(m, QLinear)}
    want = prefill(model, list(range(3, 20)))
    set_precision(model, "int8", kernels)
    linears = {name: m for name, m in model.named_modules() if isinstance(m, QLinear)}
    for name, m in linears.items():
        should = kernels.packs8(qtype_number(m.qtype), m.out_features)
        assert m.packed == should and (torch.equal(m.weight, before[name]) != should), name
    assert any(m.packed for m in linears.values())
    with pytest.raises(RuntimeError, match="packed for the int8 kernels"):
        next(m for m in linears.values() if m.packed)._dequantize(torch.zeros(0, dtype=torch.uint8))
    set_precision(model, "exact", kernels)
    assert all(not m.packed and torch.equal(m.weight, before[name]) for name, m in linears.items())
    assert torch.equal(prefill(model, list(range(3, 20))), want)


@pytest.mark.parametrize("qtype", ["q4_0", "q4_1", "q8_0"])
@pytest.mark.parametrize("rows", [8, 40])
def test_flagged_rows_read_the_packed_matrices_as_the_exact_model_reads_the_file(kernels: Any, tiny_model_dir: Path,
                                                                                 qtype: str, rows: int) -> None:
    """A scored prompt's rows (Batch.exact) on a model packed for int8 gather each packed group back to the file's
    rows before the float32 GEMM (AMX where the CPU has it, else the FMA tiles): every logit within float32
    rounding of the exact model's, which reads the file's bytes as they are."""
    from webchat.model.batch import make_batch

    ids = torch.randint(3, 200, (rows,), generator=torch.Generator().manual_seed(rows)).tolist()

    def logits(model: Any) -> torch.Tensor:
        pool = model.new_pool(rows + 16, 16)
        pages = list(range(1, 1 + (rows + 15) // 16))
        return model(make_batch([(ids, 0, pages, list(range(rows)))], 16, "cpu", [rows], None, [True]), pool)

    exact = load_model(tiny_model_dir, quantize=qtype, precision="exact")
    packed = load_model(tiny_model_dir, quantize=qtype, precision="int8")
    assert any(m.packed for m in packed.modules() if isinstance(m, QLinear))
    want, got = logits(exact), logits(packed)
    assert want.abs().max().item() > 0.1  # logits, not zeros
    assert (got - want).abs().max().item() < 1e-4


def test_zero_and_outlier_rows(kernels: Any) -> None:
    """A row of zeros gives zeros; beside a value 100 times the others, the others keep their bits (a scale per 8
    values; the K-quants' power of two per 32) where one scale for all 256 (llama.cpp's Q8_K) rounds them away."""
    k = 256
    x = torch.zeros(2, k)
    x[1] = torch.randn(k, generator=torch.Generator().manual_seed(1)) * 0.01
    x[1, 5] = 1.0
    one = x[1] / (x[1].abs().max() / 127)
    single = torch.round(one) * (x[1].abs().max() / 127)  # one scale for the row
    # the big value's own group keeps the coarse step: 7 of 255 small values (a scale per 8), 31 (per 32)
    for qtype, share in (("q8_0", 0.25), ("q4_k", 0.5)):
        wq, wd = weights(qtype, 16, k, seed=2)
        got = kernels.qmatmul(x, wq, qtype_number(qtype), k, int8=True)
        assert torch.equal(got[0], torch.zeros(16))
        exact = x[1].double() @ wd.T
        ours, theirs = (got[1].double() - exact).abs().max(), (single.double() @ wd.T - exact).abs().max()
        assert ours < share * theirs, f"{qtype}: error {ours:.3g} against {theirs:.3g} with one scale"


def test_the_int8_kernels_refuse_what_they_do_not_cover(kernels: Any) -> None:
    wq, _ = weights("q4_1", 4, 64, seed=0)
    with pytest.raises(RuntimeError, match="qtype must be 2 .*, got 10"):
        kernels.qmatmul(torch.randn(1, 64), wq, 10, 64, int8=True)  # Q2_K: no kernel, refused by its number
    with pytest.raises(RuntimeError, match="x must be float32"):
        kernels.qmatmul(torch.randn(1, 64, dtype=torch.float64), wq, 3, 64, int8=True)


# ---------------------------------------------------------------- the model's precision
def test_the_default_precision_is_int8_for_quantized_matrices_on_a_vector_path() -> None:
    assert default_precision({"q4_k", "q6_k"}, "avx2") == "int8" == default_precision({"q8_0"}, "avx512")
    assert default_precision(set(), "avx2") == "exact"  # float weights have no int8 path
    assert default_precision({"q4_1"}, "scalar") == "exact"


def test_a_model_runs_the_precision_asked_for(kernels: Any, tiny_model_dir: Path) -> None:
    best = qkernels.available_paths()[-1]
    model = load_model(tiny_model_dir, quantize="q4_1")
    assert model.precision == default_precision(quantized_formats(model), best)  # a tiny model: int8x2
    exact = load_model(tiny_model_dir, quantize="q4_1", precision="exact")
    assert exact.precision == "exact"
    assert not any(m.int8 for m in exact.modules() if isinstance(m, QLinear))
    assert exact.runner is not None and not exact.runner.int8  # type: ignore[attr-defined]
    forced = load_model(tiny_model_dir, quantize="q4_1", precision="int8")
    assert all(m.int8 for m in forced.modules() if isinstance(m, QLinear))
    assert forced.runner is not None and forced.runner.int8  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match="int8 activations need quantized matrices .*: the model has no quantized"):
        load_model(tiny_model_dir, precision="int8")  # float32 weights
    with pytest.raises(ValueError, match="precision must be one of exact, int8, int8x2, got 'fp8'"):
        load_model(tiny_model_dir, quantize="q4_1", precision="fp8")
    assert load_model(tiny_model_dir).precision == "exact"


def test_the_runtime_reports_its_precision(kernels: Any, tiny_model_dir: Path) -> None:
    """`precision` in hello (and so /api/info): int8x2 by default for a small model on a vector path, exact with
    --exact."""
    fast = load_runtime(ServerConfig(model_dir=tiny_model_dir, device="cpu", quantize="q8_0", max_seq_len=64))
    exact = load_runtime(ServerConfig(model_dir=tiny_model_dir, device="cpu", quantize="q8_0", max_seq_len=64,
                                      exact=True))
    assert fast.hello().precision == default_precision(QuantFormats({"q8_0"}, 1), qkernels.available_paths()[-1])
    assert exact.hello().precision == "exact" and exact.hello().weights == "q8_0"
    assert fast.hello().model_dump()["precision"] in ("int8x2", "exact")  # a tiny model: int8x2 on a vector path


# ---------------------------------------------------------------- a K-quant model through the C++ forward
def kquant_folder(root: Path, tiny_model_dir: Path) -> Path:
    """test_cpu_step's hd128 shape (dim 256) with its matrices as K-quant blocks, Q4_K_M-style (q, k, gate, up Q4_K;
    o Q5_K; v, down, embedding Q6_K), model.safetensors holding the blocks' values (the float32 twin)."""
    from safetensors.torch import load_file, save_file
    from test_cpu_step import model_dir

    from webchat.gguf.convert import QUANT_FILE, QUANT_KEY, QUANT_LAYOUT, QUANT_LAYOUT_KEY

    out = root / "kquant"
    if out.exists():
        return out
    src = model_dir(root, tiny_model_dir, "hd128-mha")
    import shutil

    shutil.copytree(src, out)
    tensors = load_file(str(out / "model.safetensors"))
    kinds = {"q_proj": "q4_k", "k_proj": "q4_k", "gate_proj": "q4_k", "up_proj": "q4_k", "o_proj": "q5_k"}
    blocks, types = dict(tensors), {}
    for name, t in tensors.items():
        if t.dim() == 2:
            kind = next((v for part, v in kinds.items() if part in name), "q6_k")
            blocks[name] = torch.from_numpy(ENCODERS[kind](t.numpy()))
            types[name] = kind
            tensors[name] = dequantize_k(blocks[name], kind)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    meta = {"format": "pt", QUANT_KEY: __import__("json").dumps(types), QUANT_LAYOUT_KEY: QUANT_LAYOUT}
    save_file(blocks, str(out / QUANT_FILE), metadata=meta)
    return out


@pytest.fixture(scope="module")
def kquant_dir(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Path:
    return kquant_folder(tmp_path_factory.mktemp("int8"), tiny_model_dir)


def test_a_k_quant_models_rows_are_their_own_in_any_batch_and_chunking(kernels: Any, kquant_dir: Path,
                                                                      path: str) -> None:
    """Bit for bit with int8 activations: each sequence of a mixed batch (a decode, verify rows, a prompt chunk: the
    prompt GEMM) as alone, and a prompt's k/v and last logits however it is chunked."""
    from test_cpu_step import PAGE, PROMPT_ENDS, clone, mixed_spec, setup_sequences

    from webchat.model.batch import make_batch
    from webchat.model.kv_cache import PageTable

    model = load_model(kquant_dir, precision="int8")
    assert {m.qtype for m in model.modules() if isinstance(m, QLinear)} == {"q4_k", "q5_k", "q6_k"}
    pool, tables = setup_sequences(model)
    twin = clone(pool)
    spec = mixed_spec(tables)
    together = model(make_batch(spec, PAGE, prompt_ends=PROMPT_ENDS), pool)
    alone = torch.cat([model(make_batch([s], PAGE, prompt_ends=[e]), twin)
                       for s, e in zip(spec, PROMPT_ENDS, strict=True)])
    assert torch.equal(together, alone)
    ids = torch.randint(3, 500, (30,), generator=torch.Generator().manual_seed(8)).tolist()

    def feed(chunks: list[int]) -> tuple[torch.Tensor, list[torch.Tensor]]:
        pool = model.new_pool(8 * PAGE, PAGE)
        table = PageTable(pool)
        table.ensure(len(ids))
        start = 0
        for n in chunks:
            logits = model(make_batch([(ids[start : start + n], start, table.pages, [-1])], PAGE,
                                      prompt_ends=[len(ids)]), pool)
            start += n
        slots = torch.tensor([table.pages[p // PAGE] * PAGE + p % PAGE for p in range(len(ids))])
        return logits, [t.flatten(0, 1).index_select(0, slots) for t in pool.k + pool.v]

    whole, whole_kv = feed([30])
    for chunks in ([1, 7, 22], [9, 8, 13], [1] * 30):
        logits, kv = feed(chunks)
        assert torch.equal(logits, whole), chunks
        assert all(torch.equal(a, b) for a, b in zip(kv, whole_kv, strict=True)), chunks


def test_a_k_quant_model_in_int8_against_its_float32_twin(kernels: Any, kquant_dir: Path) -> None:
    """The C++ forward in int8 against the PyTorch path in int8 (the same kernels on torch's norms and attention) and
    against float32 on the same weights: greedy tokens alike, probabilities within 3e-2."""
    from test_quant_model import greedy

    fast, floats = load_model(kquant_dir), load_model(kquant_dir, weights="float32")
    assert fast.precision == default_precision(quantized_formats(fast), qkernels.available_paths()[-1])
    fast = load_model(kquant_dir, precision="int8")
    eager = load_model(kquant_dir, precision="int8")
    eager.runner = None
    prompt = torch.randint(3, 500, (24,), generator=torch.Generator().manual_seed(11)).tolist()
    (ids_c, rows_c), (ids_e, rows_e), (ids_f, rows_f) = (greedy(m, prompt, 16) for m in (fast, eager, floats))
    assert ids_c == ids_e == ids_f
    probs = [torch.softmax(r.double(), -1) for r in (rows_c, rows_e, rows_f)]
    # each int8 path rounds its own activations (torch's norms and attention differ from C++'s in the last bits, and a
    # value on a rounding edge goes the other way): both ~1-2e-2 from float32 on this random model, and from each other
    gaps = [(probs[a] - probs[b]).abs().max().item() for a, b in ((0, 1), (0, 2), (1, 2))]
    assert max(gaps) <= 3e-2, gaps


@pytest.mark.parametrize("runner", ["cpu_step", "pytorch"])
@pytest.mark.parametrize("chunk", [256, 7])
def test_prompt_scores_are_exact_whatever_the_precision(kernels: Any, kquant_dir: Path, chunk: int,
                                                        runner: str) -> None:
    """A request's prompt_logprobs (the heatmap's prompt scores, echo) are the exact path's at every precision,
    however the prompt is chunked, on the C++ forward and on the PyTorch path alike (Batch.exact: its prompt rows at
    float32); the same prompt's plain prefill at int8 is not."""
    from test_prompt_logprobs import GREEDY, check, drain

    from webchat.engine.generator import Generator
    from webchat.engine.sequence import GenerationRequest
    from webchat.model.batch import make_batch
    from webchat.model.kv_cache import PageTable
    from webchat.text.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(kquant_dir)
    ids = torch.randint(3, 500, (40,), generator=torch.Generator().manual_seed(12)).tolist()

    def whole(model: Any) -> torch.Tensor:  # one forward of the whole prompt, as a prompt, unflagged
        pool = model.new_pool(len(ids) + 16, 16)
        table = PageTable(pool)
        table.ensure(len(ids))
        batch = make_batch([(ids, 0, table.pages, list(range(len(ids))))], 16, prompt_ends=[len(ids)])
        return torch.log_softmax(model(batch, pool).float(), dim=-1)

    want = whole(load_model(kquant_dir, precision="exact"))
    for precision in ("int8", "int8x2", "exact"):
        model = load_model(kquant_dir, precision=precision)
        if runner == "pytorch":
            model.runner = None
        gen = Generator(model, tok, prefill_chunk=chunk)
        gen.begin_stream(GenerationRequest(prompt_ids=ids, settings=GREEDY, max_new_tokens=2, prompt_logprobs=5))
        scored = drain(gen)[0]
        assert scored is not None
        check(scored, ids, want, 5, tok)
        if precision == "int8":
            gap = (whole(model) - want).abs().max().item()
            assert gap > 1e-4, f"int8's plain prefill agrees with exact to {gap}: the comparison shows nothing"


# ---------------------------------------------------------------- the real default model
# ten more short chat prompts beside test_fidelity's six: what one prompt's 32 greedy tokens do under int8 is a matter
# of luck (a float32 rounding that moves one activation across an int8 step changes every step after it: the C++
# forward and the PyTorch path, the same kernels on torch's norms, differ by 0.2 in the logits), so the fidelity of the
# int8 path is judged over sixteen
MORE_PROMPTS = [[{"role": "user", "content": q}] for q in (
    "What is the capital of France?", "Write a haiku about autumn.", "Explain photosynthesis simply.",
    "List three prime numbers.", "How do I boil an egg?", "What is 12 times 7?", "Describe a cat in one sentence.",
    "Why is the sky blue?", "Give me a synonym for happy.", "What does HTTP stand for?")]


@pytest.mark.real_model
def test_the_default_model_in_int8_against_float32(real_model_dir: Path) -> None:
    """On sixteen chat prompts, against float32 on the same weights: the first token's top-5 probabilities within
    6e-2 on each (llama-server's largest on the same model at Q4_K_M, bench/fidelity_llama_cpp.py: 8.5e-2) and 2e-2 on
    average, and 32 greedy tokens the same on at least llama-server's share (3 of 8: 6 of 16). Which prompts agree
    moves with the CPU (torch's float ops differ between AVX2 and AVX-512): 8 or more of 16 on a Zen 3, 7 on a Zen 4."""
    from test_fidelity import PROMPTS
    from test_quant_model import greedy

    from webchat.text.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(real_model_dir)
    fast, floats = load_model(real_model_dir, precision="int8"), load_model(real_model_dir, weights="float32")
    assert any(m.packed for m in fast.modules() if isinstance(m, QLinear))  # the default's path: packed rows
    same, gaps = 0, []
    for messages in [*PROMPTS, *MORE_PROMPTS]:
        ids = tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True))
        (ids_8, rows_8), (ids_f, rows_f) = greedy(fast, ids, 32), greedy(floats, ids, 32)
        p8, pf = torch.softmax(rows_8[0].double(), -1), torch.softmax(rows_f[0].double(), -1)
        top = pf.topk(5).indices
        gaps.append((p8[top] - pf[top]).abs().max().item())
        same += ids_8 == ids_f
    assert max(gaps) <= 6e-2 and sum(gaps) / len(gaps) <= 2e-2, gaps
    assert same >= 6, f"{same} of 16 prompts' 32 greedy tokens as float32's (llama-server's share: 6)"


@pytest.mark.real_model
@pytest.mark.parametrize("mode", ["self", "ngram"])
def test_speculation_never_changes_the_int8_output(real_model_dir: Path, mode: str) -> None:
    from webchat.engine.generator import Generator
    from webchat.engine.sequence import GenerationRequest
    from webchat.engine.settings import SamplingSettings
    from webchat.text.tokenizer import Tokenizer

    model, tok = load_model(real_model_dir, precision="int8"), Tokenizer.from_dir(real_model_dir)
    text = "Fix the typo and repeat it: 'The quick brown fox jumps ovre the lazy dog near the river bank.'"
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": text}]))

    def run(spec: str) -> list[int]:
        gen = Generator(model, tok, max_seq_len=256)
        gen.begin_stream(GenerationRequest(prompt_ids=prompt, stop_token_ids=[], max_new_tokens=24, speculative=spec,
                                           settings=SamplingSettings(temperature=0.0)))
        out: list[int] = []
        while not (res := gen.stream()).eos:
            out += res.token_ids
        return out + res.token_ids

    assert run(mode) == run("none")


def test_set_vnni_names_a_wrong_setting_and_a_missing_avx_vnni(kernels: Any) -> None:
    """set_vnni takes -1, 0, 1 and 2 (AVX-VNNI's forms); anything else, and 2 where the CPU has no AVX-VNNI, is refused
    by name, the setting left as it was."""
    try:
        kernels.set_vnni(0)
        for bad in (3, -2):
            with pytest.raises(RuntimeError, match=rf"vnni must be -1 .*0, 1 or 2 .*got {bad}"):
                kernels.set_vnni(bad)
        assert not kernels.vnni()
        has_avxvnni = "avx_vnni" in Path("/proc/cpuinfo").read_text().split()
        if has_avxvnni:
            assert kernels.set_vnni(2) and kernels.vnni()
        else:
            with pytest.raises(RuntimeError, match="this CPU has no AVX-VNNI"):
                kernels.set_vnni(2)
            assert not kernels.vnni()
    finally:
        kernels.set_vnni(-1)


@pytest.mark.parametrize("value", ["0", "1", "yes"])
def test_webchat_vnni_turns_vpdpbusd_off_or_on_and_names_a_wrong_value(kernels: Any, monkeypatch: pytest.MonkeyPatch,
                                                                      value: str) -> None:
    """WEBCHAT_VNNI=0 gives the kernels of a CPU without VNNI (with WEBCHAT_QPATH=avx2, a Zen 3's: the bench's AVX2
    class on an AVX-512 machine); 1 asks for vpdpbusd and is refused by name where the CPU has none."""
    monkeypatch.setenv("WEBCHAT_VNNI", value)
    try:
        if value == "yes":
            with pytest.raises(qkernels.KernelsUnavailable, match="WEBCHAT_VNNI must be 0 or 1, got 'yes'"):
                qkernels.apply_environment(kernels)
            return
        try:
            qkernels.apply_environment(kernels)
        except qkernels.KernelsUnavailable as exc:
            assert value == "1" and str(exc).startswith("WEBCHAT_VNNI=1: ") and "VNNI" in str(exc)[16:]
            return
        assert kernels.vnni() is (value == "1")
    finally:
        kernels.set_vnni(-1)
