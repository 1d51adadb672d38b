"""The C++ CPU kernels against a plain reference: dequantize-then-matmul in float64, the sampler's row scans against
softmax in float64 and the torch ops they replace.

Every code path this CPU can run (scalar, avx2, avx512) is forced in turn; shapes are odd on purpose: one output row,
one block per row, output rows not a multiple of the 16-row tile, activation rows not a multiple of 4.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

from webchat.engine.sampling import RowAsk, Sampler, sample_batch
from webchat.engine.settings import SamplingSettings
from webchat.gguf.blocks import QTYPES, dequantize, quantize
from webchat.kernels.cpu import build as qkernels

# (M activation rows, N output rows, K) — K is always whole blocks of 32
SHAPES = [(1, 1, 32), (1, 192, 576), (3, 7, 96), (5, 33, 160), (4, 16, 64), (9, 40, 1536), (70, 17, 64),
          (7, 19, 2080)]


@pytest.fixture(params=["scalar", "avx2", "avx512"])
def path(request: pytest.FixtureRequest, kernels: Any) -> Iterator[str]:
    name = str(request.param)
    if name not in qkernels.available_paths():
        pytest.skip(f"this CPU cannot run the {name} path (it runs {qkernels.available_paths()})")
    kernels.set_path(qkernels.PATHS[name])
    yield name
    kernels.set_path(-1)


def reference(x: torch.Tensor, wq: torch.Tensor, qtype: str) -> torch.Tensor:
    return (x.double() @ dequantize(wq, qtype).double().T).float()


@pytest.mark.parametrize("gemm", [False, True], ids=["rows", "gemm"])  # the row kernels; the prompt rows' GEMM
@pytest.mark.parametrize("qtype", list(QTYPES))
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_qmatmul_matches_dequantize_then_matmul(kernels: Any, path: str, qtype: str, shape: tuple[int, ...],
                                                gemm: bool) -> None:
    m, n, k = shape
    gen = torch.Generator().manual_seed(m * 1000 + n + k)
    wq = quantize(torch.randn(n, k, generator=gen), qtype)
    x = torch.randn(m, k, generator=gen)
    got = kernels.qmatmul(x, wq, QTYPES[qtype][0], k, gemm=gemm)
    want = reference(x, wq, qtype)
    # float32 accumulation in another order: error ~ eps * sqrt(K) * |x||w|, far below 1e-4 of the scale here
    tol = 2e-6 * k**0.5 * float(want.abs().max().clamp(min=1.0))
    assert got.shape == (m, n)
    assert (got - want).abs().max().item() <= tol, f"{path} {qtype} {shape}: max error above {tol:.1e}"


@pytest.mark.parametrize("gemm", [False, True], ids=["rows", "gemm"])
@pytest.mark.parametrize("qtype", list(QTYPES))
# one block, an odd count (AVX2 Q4 pairs blocks), an even one, a long row (65 blocks, past L1 in the GEMM's tile)
@pytest.mark.parametrize("k", [32, 96, 576, 2080])
def test_a_rows_result_does_not_depend_on_the_rows_beside_it(kernels: Any, path: str, qtype: str, k: int,
                                                             gemm: bool) -> None:
    """Bit for bit: row i of an m-row call equals row i alone (every group size a path takes rows in: 1 to 8, 9;
    the GEMM's passes of 1 to 6 rows and its 16-row weight tiles in groups of 4 or 2, 37 rows = 2 tiles and 5)."""
    gen = torch.Generator().manual_seed(k)
    wq = quantize(torch.randn(37, k, generator=gen), qtype)
    x = torch.randn(13, k, generator=gen)
    alone = torch.cat([kernels.qmatmul(x[i : i + 1], wq, QTYPES[qtype][0], k, gemm=gemm) for i in range(13)])
    for m in (2, 3, 5, 6, 8, 9, 13):
        got = kernels.qmatmul(x[:m], wq, QTYPES[qtype][0], k, gemm=gemm)
        assert torch.equal(got, alone[:m]), f"{path} {qtype} m={m}"


def test_bias_and_strided_input(kernels: Any) -> None:
    gen = torch.Generator().manual_seed(1)
    wq = quantize(torch.randn(48, 64, generator=gen), "q4_1")
    x = torch.randn(6, 128, generator=gen)[:, ::2]  # not contiguous
    bias = torch.randn(48, generator=gen)
    got = kernels.qmatmul(x, wq, QTYPES["q4_1"][0], 64, bias)
    assert torch.allclose(got, reference(x, wq, "q4_1") + bias, atol=1e-4)


@pytest.mark.parametrize("qtype", list(QTYPES))
def test_dequantize_is_bit_exact_to_gguf(kernels: Any, path: str, qtype: str) -> None:
    """On every path: the vector paths' dequantization (the PyTorch path's matrices, the GEMM's tiles) gives the
    scalar values bit for bit."""
    wq = quantize(torch.randn(37, 96, generator=torch.Generator().manual_seed(2)), qtype)
    assert torch.equal(kernels.dequantize(wq, QTYPES[qtype][0], 96), dequantize(wq, qtype))
    ids = torch.tensor([36, 0, 5, 5])
    assert torch.equal(kernels.dequantize(wq, QTYPES[qtype][0], 96, ids), dequantize(wq, qtype)[ids])


def test_wrong_inputs_are_refused_by_name(kernels: Any) -> None:
    wq = quantize(torch.randn(8, 64), "q8_0")
    with pytest.raises(RuntimeError, match="x must be float32"):
        kernels.qmatmul(torch.randn(1, 64, dtype=torch.float64), wq, QTYPES["q8_0"][0], 64)
    with pytest.raises(RuntimeError, match="rows must hold 68 bytes for K=64, got 40"):
        kernels.qmatmul(torch.randn(1, 64), quantize(torch.randn(8, 64), "q4_1"), QTYPES["q8_0"][0], 64)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        kernels.qmatmul(torch.randn(1, 48), wq, QTYPES["q8_0"][0], 48)
    with pytest.raises(RuntimeError, match="out of range"):
        kernels.dequantize(wq, QTYPES["q8_0"][0], 64, torch.tensor([8]))


def scan_rows() -> tuple[torch.Tensor, list[int]]:
    """Rows of a vocabulary's size and of odd sizes (not whole vectors), with ties at the top and in the middle; the
    tokens asked about: a row's best, one of its tied values, one anywhere."""
    g = torch.Generator().manual_seed(5)
    rows = []
    for n in (49152, 1003, 7):
        x = torch.randn(n, generator=g) * 4
        x[n // 3 : n // 3 + 3] = x.max() + 1  # three tied best
        x[n // 2 : n // 2 + 2] = x[1]  # a tie below
        rows.append(x)
    width = max(r.numel() for r in rows)
    return torch.stack([torch.nn.functional.pad(r, (0, width - r.numel()), value=-1e30) for r in rows]), [
        int(rows[0].argmax()), 1003 // 2 + 1, 3]


def test_the_samplers_row_scans_match_softmax_in_float64(kernels: Any, path: str) -> None:
    x, tokens = scan_rows()
    assert kernels.argmax_rows(x) == x.argmax(-1).tolist()  # the first of tied best, as torch picks
    ks = [20, 5, 7]
    found = kernels.describe_rows(x, [0, 1, 2], tokens, ks)
    for r, (token, k, (prob, rank, top)) in enumerate(zip(tokens, ks, found, strict=True)):
        p = torch.softmax(x[r].double(), -1)
        assert prob == pytest.approx(float(p[token]), rel=1e-6, abs=1e-30)
        assert rank == int((x[r] > x[r, token]).sum()) + 1
        order = sorted(range(x.shape[1]), key=lambda i: (-float(x[r, i]), i))[:k]  # ties: the lower id first
        assert [t for t, _ in top] == order
        assert [v for _, v in top] == pytest.approx([float(p[i]) for i in order], rel=1e-6, abs=1e-30)


def test_sample_batch_with_the_scans_matches_the_torch_ops(kernels: Any) -> None:
    x = torch.randn(3, 49152, generator=torch.Generator().manual_seed(9)) * 3
    settings = [SamplingSettings(temperature=0.0), SamplingSettings(temperature=0.8, seed=4),
                SamplingSettings(temperature=0.0, token_bias={7: 50.0})]

    def asks() -> list[RowAsk]:
        return [RowAsk(Sampler(s, 49152), [1, 2, 3], top_alts=5, want_probs=True) for s in settings]

    fast, slow = sample_batch(x, asks(), kernels), sample_batch(x, asks())
    assert [c.token for c in fast] == [c.token for c in slow] and fast[2].token == 7
    for f, s in zip(fast, slow, strict=True):
        assert (f.rank, f.sampled_prob, [t for t, _ in f.top]) == (s.rank, s.sampled_prob, [t for t, _ in s.top])
        assert f.prob == pytest.approx(s.prob, rel=2e-5)  # torch's float32 softmax is the less exact of the two
        assert [v for _, v in f.top] == pytest.approx([v for _, v in s.top], rel=2e-5)


def test_the_greedy_scan_adds_each_rows_token_bias_as_index_add_does_and_leaves_the_logits(kernels: Any,
                                                                                           path: str) -> None:
    x, _ = scan_rows()
    best = x.argmax(-1).tolist()
    tie = float(x[1].max() - x[1, 5])  # lifts token 5 of row 1 onto the best logit: a tie, the lower id wins
    ids, values = [[best[0], 11], [5], []], [[-100.0, 0.3], [tie], []]
    before = x.clone()
    picks = kernels.argmax_rows(x, ids, values)
    assert torch.equal(x, before)  # every logit back as it was, bit for bit
    want = []
    for r in range(3):
        row = x[r].clone()
        row.index_add_(0, torch.tensor(ids[r], dtype=torch.long), torch.tensor(values[r]))
        want.append(int(row.argmax()))
    assert picks == want and picks[0] != best[0] and picks[2] == best[2]
    with pytest.raises(RuntimeError, match="bias id 49152 is outside the vocabulary of 49152"):
        kernels.argmax_rows(x, [[49152], [], []], [[1.0], [], []])
    with pytest.raises(RuntimeError, match="one list per row"):
        kernels.argmax_rows(x, [[1]], [[1.0]])
    assert torch.equal(x, before)


def test_the_row_scans_refuse_what_is_outside_the_logits(kernels: Any) -> None:
    x = torch.randn(2, 10)
    with pytest.raises(RuntimeError, match="row 2 is outside the 2 logits rows"):
        kernels.describe_rows(x, [2], [0], [1])
    with pytest.raises(RuntimeError, match="token 10 is outside the vocabulary of 10"):
        kernels.describe_rows(x, [0], [10], [1])
    with pytest.raises(RuntimeError, match="cannot list 11 alternatives of 10"):
        kernels.describe_rows(x, [0], [0], [11])
    with pytest.raises(RuntimeError, match="logits must be a contiguous float32"):
        kernels.argmax_rows(x.double())
