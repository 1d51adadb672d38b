"""Exact numbers on a quantizing model (docs/quant.md, "Precisions"): a sequence flagged exact (a prompt scored) runs
its prompt rows at float32 beside sequences at the model's precision, which keep their bits; the exact prompt GEMM's
AMX tiles against float64 and against its FMA tiles; which precision a model runs by default."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from test_int8 import K_QTYPES, QTYPES, qtype_number, weights

from webchat.kernels.backend import load_model
from webchat.kernels.cpu import build as qkernels
from webchat.model.batch import make_batch
from webchat.model.kv_cache import PageTable
from webchat.model.precision import INT8X2_MAX_WEIGHTS, QuantFormats, default_precision

PAGE = 16


def feed(model: Any, spec: list[tuple[list[int], int, list[int], list[int]]], pool: Any, prompt_ends: list[int],
         exact: list[bool] | None = None) -> torch.Tensor:
    return model(make_batch(spec, PAGE, prompt_ends=prompt_ends, exact=exact), pool)


@pytest.mark.parametrize("precision", ["int8", "int8x2"])
@pytest.mark.parametrize("rows", [24, 12])
def test_a_scored_prompt_runs_exact_beside_a_decode(kernels: Any, tiny_model_dir: Path, precision: str,
                                                    rows: int) -> None:
    """In one batch: a decode at the model's precision and a prompt chunk flagged exact with every row's logits (24 or
    12 rows: the AMX tiles where the CPU has them, else the FMA tiles). The prompt's logits are
    the exact model's (within float32 rounding: the head reads packed rows through the GEMM, the exact model's through
    its row kernels); the decode's bits are its own alone; the flag moves nothing past the prompt (a flagged decode
    row is the model's precision). Unflagged, the prompt's rows take the model's prompt precision: int8x2's are exact
    where the AMX tiles are."""
    fast = load_model(tiny_model_dir, quantize="q4_1", precision=precision)
    exact = load_model(tiny_model_dir, quantize="q4_1", precision="exact")
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(3, 500, (rows,), generator=gen).tolist()
    past = torch.randint(3, 500, (9,), generator=gen).tolist()

    def run(model: Any, flags: list[bool] | None, both: bool = True) -> list[torch.Tensor]:
        pool = model.new_pool(8 * PAGE, PAGE)
        t1, t2 = PageTable(pool), PageTable(pool)
        t1.ensure(40), t2.ensure(40)
        feed(model, [(past, 0, t2.pages, [-1])], pool, [9])
        spec = [(ids, 0, t1.pages, list(range(len(ids)))), ([7], 9, t2.pages, [-1])]
        if not both:
            return [feed(model, spec[1:], pool, [9])]
        out = feed(model, spec, pool, [rows, 9], flags)
        return [out[:rows], out[rows:]]

    scored, decode = run(fast, [True, False])
    (want, _), (alone,) = run(exact, None), run(fast, None, both=False)
    assert (scored - want).abs().max() <= 1e-4
    assert torch.equal(decode, alone)
    plain, _ = run(fast, None)
    if fast.runner.prompt_precision == "exact":  # int8x2's prompt rows where the exact GEMM has AMX tiles
        assert precision == "int8x2" and qkernels.amx_tiles(kernels)
        assert (plain - want).abs().max() <= 1e-4
    else:  # unflagged, the prompt takes the model's precision
        assert (plain - want).abs().max() > 1e-4
    _, flagged_decode = run(fast, [True, True])
    assert torch.equal(flagged_decode, alone)


def test_exact_flags_are_one_a_sequence(kernels: Any, tiny_model_dir: Path) -> None:
    model = load_model(tiny_model_dir, quantize="q4_1", precision="int8x2")
    pool = model.new_pool(4 * PAGE, PAGE)
    table = PageTable(pool)
    table.ensure(8)
    with pytest.raises(ValueError, match="one flag per sequence"):
        feed(model, [([5, 6], 0, table.pages, [-1])], pool, [2], [True, False])


# ---------------------------------------------------------------- the AMX tiles
@pytest.fixture
def amx(kernels: Any) -> Iterator[None]:
    if not kernels.set_amx(-1) or qkernels.available_paths()[-1] != "avx512":
        pytest.skip("this CPU (or its OS) gives no AMX-BF16 tiles: the exact GEMM runs its FMA tiles")
    kernels.set_path(-1)
    yield
    kernels.set_amx(-1)


@pytest.mark.parametrize("qtype", [*QTYPES, *K_QTYPES])
def test_amx_tiles_sum_float32_products(kernels: Any, amx: None, qtype: str) -> None:
    """Every format against float64 (x @ the dequantized W) within float32's rounding of the sum of |products|, as
    the FMA tiles (which `--exact` keeps); a row's outputs the same bits alone or among 40 (each tile element is its
    own sum)."""
    n, k = 40, 768 if qtype in K_QTYPES else 544
    blocks, wd = weights(qtype, n, k, seed=7)
    x = torch.randn(40, k, generator=torch.Generator().manual_seed(8)) * 3
    want, scale = x.double() @ wd.T, x.double().abs() @ wd.abs().T
    got = kernels.qmatmul(x, blocks, qtype_number(qtype), k, None, True, amx=True)
    fma = kernels.qmatmul(x, blocks, qtype_number(qtype), k, None, True)  # the FMA tiles (--exact's)
    bound = 2 * k * 2.0**-24 * scale
    assert ((got.double() - want).abs() <= bound).all()
    assert ((fma.double() - want).abs() <= bound).all()
    assert not torch.equal(got, fma)  # two kernels: the same sums in other orders
    for r in (0, 17, 39):
        alone = kernels.qmatmul(x[r : r + 1].contiguous(), blocks, qtype_number(qtype), k, None, True, amx=True)
        assert torch.equal(alone[0], got[r])


def test_int8x2_prompt_rows_are_exact_only_where_the_tiles_run(kernels: Any, amx: None, tiny_model_dir: Path) -> None:
    """The prompt's precision follows the path that runs: exact on AVX-512 with the tiles, int8x2 on a forced AVX2
    path of the same CPU (its exact GEMM would be the FMA tiles, slower than int8x2's)."""
    assert load_model(tiny_model_dir, quantize="q4_1", precision="int8x2").runner.prompt_precision == "exact"
    kernels.set_path(qkernels.PATHS["avx2"])
    try:
        forced = load_model(tiny_model_dir, quantize="q4_1", precision="int8x2")
    finally:
        kernels.set_path(-1)
    assert forced.runner.prompt_precision == "int8x2"


def test_amx_is_refused_by_name_where_it_is_not(kernels: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(RuntimeError, match="amx must be -1"):
        kernels.set_amx(3)
    monkeypatch.setenv("WEBCHAT_AMX", "2")
    with pytest.raises(qkernels.KernelsUnavailable, match="WEBCHAT_AMX must be 0 or 1, got '2'"):
        qkernels.apply_environment(kernels)


# ---------------------------------------------------------------- the default
def test_the_default_precision_follows_the_models_size() -> None:
    small, large = QuantFormats({"q4_1", "q8_0"}, 134_515_008), QuantFormats({"q4_k", "q6_k"}, 1_100_000_000)
    assert default_precision(small, "avx512") == "int8x2" == default_precision(small, "avx2")
    assert default_precision(large, "avx512") == "int8" == default_precision({"q4_1"}, "avx2")  # size unknown: int8
    assert default_precision(QuantFormats({"q4_1"}, INT8X2_MAX_WEIGHTS + 1), "avx2") == "int8"
    assert default_precision(small, "scalar") == "exact" == default_precision(QuantFormats(set(), 0), "avx512")
