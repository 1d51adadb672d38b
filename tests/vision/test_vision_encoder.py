"""The encoder: PyTorch path against transformers fp32 (image features after the projector), the C++ forward against
the PyTorch path (exact within float rounding; int8 within a printed bound), on both fixtures and on tiny files."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.vision.pictures import as_image, picture
from tests.vision.tiny_projector import write_projector
from webchat.vision.projector import ImagePlan, Projector, load_projector

EXACT = 1e-4  # max |d| / max |reference|: float rounding of a different summation order
INT8 = 5e-2  # 8-bit activations (a scale per 8 values) against Q8_0 blocks; measured ~1e-2 (printed)


def rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    return float((a - ref).abs().max() / ref.abs().max())


def transformers_features(hf_dir: Path, kind: str, tiles: torch.Tensor) -> torch.Tensor:
    import transformers

    cls = "Idefics3ForConditionalGeneration" if kind == "idefics3" else "Gemma3ForConditionalGeneration"
    model = getattr(transformers, cls).from_pretrained(hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        if kind == "idefics3":
            out = model.model.get_image_features(tiles[None], return_dict=True).pooler_output
            return torch.cat(list(out))
        out = model.model.get_image_features(tiles, return_dict=True).pooler_output
        return out.reshape(-1, out.shape[-1])


@pytest.fixture(scope="module", params=["idefics3", "gemma3"])
def case(request: pytest.FixtureRequest, fixtures: dict[str, Any]) -> dict[str, Any]:
    """A fixture's PyTorch projector, a plan (idefics3: a 1024 x 512 image, 2 tiles + global) and its reference rows."""
    kind = request.param
    fx = fixtures[kind]
    proj = load_projector(fx.mmproj_f16, backend="torch")
    plan = proj.plan(as_image(picture(1024, 512, seed=7)), max_tiles=2)
    return {"kind": kind, "fx": fx, "proj": proj, "plan": plan, "ref": proj.encode_reference(plan.tiles)}


def test_the_pytorch_encoder_is_transformers(case: dict[str, Any]) -> None:
    expected = transformers_features(case["fx"].hf_dir, case["kind"], case["plan"].tiles)
    assert case["ref"].shape == expected.shape == (case["plan"].n_tokens, case["proj"].text_dim)
    assert rel(case["ref"], expected) < EXACT


def test_the_cpp_forward_is_the_pytorch_encoder(case: dict[str, Any], kernels: Any) -> None:
    exact = load_projector(case["fx"].mmproj_f16, precision="exact", backend="cpp")
    err = rel(exact.encode_tiles(case["plan"].tiles), case["ref"])
    assert err < EXACT
    int8 = load_projector(case["fx"].mmproj_f16, precision="int8", backend="cpp")
    err8 = rel(int8.encode_tiles(case["plan"].tiles), case["ref"])
    print(f"\n{case['kind']}: C++ exact max|d|/max {err:.2e}, int8 {err8:.2e}")
    assert err8 < INT8


def test_a_q8_0_file_exact_and_int8(case: dict[str, Any], kernels: Any) -> None:
    q8 = case["fx"].mmproj_q8_0
    ref = load_projector(q8, backend="torch").encode_reference(case["plan"].tiles)
    assert rel(load_projector(q8, precision="exact", backend="cpp").encode_tiles(case["plan"].tiles), ref) < EXACT
    assert rel(load_projector(q8, precision="int8", backend="cpp").encode_tiles(case["plan"].tiles), ref) < INT8
    assert rel(ref, case["ref"]) < INT8  # the file's Q8_0 rounding, against its F16 weights


@pytest.mark.parametrize("kind", ["idefics3", "gemma3"])
def test_tiny_files_batched_tiles_are_each_tiles_own(tmp_path: Path, kind: str, kernels: Any) -> None:
    path = write_projector(tmp_path / f"{kind}.gguf", kind, seed=3)
    ref = load_projector(path, backend="torch")
    tiles = torch.randn(10, 3, 32, 32, generator=torch.Generator().manual_seed(0))  # two forwards of BATCH_TILES
    expected = ref.encode_tiles(tiles)
    for precision, bound in (("exact", EXACT), ("int8", INT8)):
        cpp = load_projector(path, precision=precision, backend="cpp")
        got = cpp.encode_tiles(tiles)
        assert got.shape == expected.shape and rel(got, expected) < bound
        alone = torch.cat([cpp.encode_tiles(tiles[i:i + 1]) for i in range(3)])
        assert rel(alone, got[: alone.shape[0]]) < EXACT


def test_encode_caches_by_content(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    proj = load_projector(write_projector(tmp_path / "p.gguf"), backend="torch")
    calls: list[int] = []
    original = Projector.encode_tiles

    def counted(self: Projector, tiles: torch.Tensor) -> torch.Tensor:
        calls.append(tiles.shape[0])
        return original(self, tiles)

    monkeypatch.setattr(Projector, "encode_tiles", counted)
    image = as_image(picture(100, 60))
    first: ImagePlan = proj.plan(image)
    rows = proj.encode(first)
    assert rows.shape == (first.n_tokens, proj.text_dim) and calls == [first.tiles.shape[0]]
    assert proj.encode(proj.plan(image)) is rows and len(calls) == 1
    smaller = proj.plan(image, max_tiles=1)  # another longest edge: another key
    assert smaller.key != first.key and proj.encode(smaller).shape[0] == smaller.n_tokens and len(calls) == 2


def test_int8_needs_the_kernels(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="int8 precision needs the C"):
        load_projector(write_projector(tmp_path / "p.gguf"), precision="int8", backend="torch")
    with pytest.raises(ValueError, match="precision must be one of exact, int8; got 'fp8'"):
        load_projector(write_projector(tmp_path / "q.gguf"), precision="fp8")


def test_exact_matrices_take_amx_only_where_they_split_into_two_bfloat16(tmp_path: Path, kernels: Any) -> None:
    from webchat.vision.native import build_tower
    from webchat.vision.projector_file import read_projector

    if not torch.cpu._is_amx_tile_supported():
        pytest.skip("no AMX on this CPU: every exact matrix takes torch's sgemm")
    tiles = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    for f16, expected in ((True, 4 * 2 + 1), (False, 0)):  # the layers' matrices and the projection; F32: none
        pf = read_projector(write_projector(tmp_path / f"f16-{f16}.gguf", f16=f16))
        ref = load_projector(pf.path, backend="torch").encode_tiles(tiles)
        tower = build_tower(kernels, pf, "exact", amx=True)
        assert tower.amx_matrices() == expected
        assert rel(tower.forward(tiles), ref) < EXACT
        assert build_tower(kernels, pf, "exact", amx=False).amx_matrices() == 0
