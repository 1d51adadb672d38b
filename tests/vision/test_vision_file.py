"""Reading projector GGUFs: the converter's keys on both fixtures, and hostile or unsupported files refused by name."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from gguf_bombs import array_bomb, header

from tests.vision.tiny_projector import write_projector
from webchat.gguf.header import GGUFError
from webchat.vision.projector_file import ProjectorError, read_projector


def test_the_converters_keys_on_the_smolvlm_fixture(smolvlm: Any) -> None:
    for path, matrix in ((smolvlm.mmproj_f16, "f16"), (smolvlm.mmproj_q8_0, "q8_0")):
        pf = read_projector(path)
        c = pf.config
        assert (c.kind, c.image_size, c.patch_size, c.width, c.ffn, c.heads) == ("idefics3", 512, 16, 768, 3072, 12)
        assert (c.scale_factor, c.longest_edge, c.text_dim, c.tokens_per_tile, c.layers) == (4, 2048, 576, 64, 2)
        assert c.image_mean == (0.5, 0.5, 0.5) and abs(c.eps - 1e-6) < 1e-12
        assert pf.tensors["0.q.weight"].type_name == matrix and pf.tensors["proj.weight"].shape == (12288, 576)
        assert pf.tensors["pos"].type_name == "f32"


def test_the_converters_keys_on_the_gemma3_fixture(gemma3: Any) -> None:
    pf = read_projector(gemma3.mmproj_q8_0)
    c = pf.config
    assert (c.kind, c.image_size, c.patch_size, c.width, c.ffn, c.heads) == ("gemma3", 896, 14, 1152, 4304, 16)
    assert (c.scale_factor, c.text_dim, c.tokens_per_tile, c.side) == (4, 640, 256, 64)
    assert pf.tensors["0.up.weight"].type_name == "q8_0"
    assert pf.tensors["0.down.weight"].type_name == "f16"  # 4304 is no multiple of 32: the converter keeps F16
    assert pf.tensors["proj.weight"].type_name == "f16" and pf.tensors["proj.weight"].shape == (640, 1152)


def test_a_tiny_projector_reads_back(tmp_path: Path) -> None:
    c = read_projector(write_projector(tmp_path / "p.gguf", meta={"clip.vision.preproc_image_size": 96})).config
    assert (c.image_size, c.side, c.tokens_per_tile, c.head_dim, c.longest_edge) == (32, 4, 4, 16, 96)
    old = read_projector(write_projector(tmp_path / "old.gguf", meta={"clip.vision.preproc_image_size": None}))
    assert old.config.longest_edge == 4 * 32  # the processor's default where an older converter wrote no size


@pytest.mark.parametrize(("meta", "words"), [
    ({"clip.projector_type": "qwen2vl_merger"}, "projector type 'qwen2vl_merger' is not supported; webchat reads "
                                                 "idefics3, gemma3"),
    ({"clip.projector_type": None}, "projector type None is not supported"),
    ({"clip.has_vision_encoder": False}, "clip.has_vision_encoder is False"),
    ({"clip.vision.block_count": None}, "key 'clip.vision.block_count' is missing"),
    ({"clip.vision.block_count": 1_000_000}, "layers is 1000000; expected 1 to 128"),
    ({"clip.vision.embedding_length": "wide"}, "key 'clip.vision.embedding_length' is 'wide'; expected an integer"),
    ({"clip.vision.attention.head_count": 5}, "width 32 of the head count 5"),
    ({"clip.vision.projector.scale_factor": 3}, "4 patches a side do not divide by the projector's scale factor 3"),
    ({"clip.vision.preproc_image_size": 512}, "more than 6 tiles a side"),
    ({"clip.vision.image_std": [0.5, 0.0, 0.5]}, "image_std is (0.5, 0.0, 0.5)"),
    ({"clip.vision.image_mean": [0.5, 0.5]}, "expected three floats"),
])
def test_bad_settings_are_refused_by_name(tmp_path: Path, meta: dict[str, Any], words: str) -> None:
    path = write_projector(tmp_path / "bad.gguf", meta=meta)
    with pytest.raises(ProjectorError) as exc:
        read_projector(path)
    assert words in str(exc.value) and "bad.gguf" in str(exc.value)


def test_bad_tensors_are_refused_by_name(tmp_path: Path) -> None:
    cases = [
        ({"drop": ("v.blk.1.attn_k.weight",)}, "tensor 'v.blk.1.attn_k.weight' is missing"),
        ({"replace": {"v.blk.0.ffn_up.weight": np.zeros((64, 16), np.float32)}},
         "tensor 'v.blk.0.ffn_up.weight' has shape [16, 64]; the settings ask for [32, 64]"),
        ({"replace": {"v.post_ln.bias": np.zeros(32, np.int32)}},
         "tensor 'v.post_ln.bias' is i32; webchat reads f16, f32"),
    ]
    for i, (kw, words) in enumerate(cases):
        path = write_projector(tmp_path / f"t{i}.gguf", **kw)
        with pytest.raises(ProjectorError, match=None) as exc:
            read_projector(path)
        assert words in str(exc.value)


def test_a_text_model_is_not_a_projector(smolvlm: Any) -> None:
    with pytest.raises(ProjectorError, match="general.architecture is 'llama'; a projector file"):
        read_projector(smolvlm.text_gguf)


def test_hostile_headers_are_refused_by_the_gguf_reader(tmp_path: Path) -> None:
    with pytest.raises(GGUFError, match="declares an array of 1152921504606846976"):
        read_projector(array_bomb(tmp_path / "bomb.gguf"))
    (tmp_path / "many.gguf").write_bytes(header(1 << 40, 0) + b"\0" * 64)
    with pytest.raises(GGUFError, match="declares 1099511627776 tensors"):
        read_projector(tmp_path / "many.gguf")
    good = write_projector(tmp_path / "good.gguf").read_bytes()
    (tmp_path / "cut.gguf").write_bytes(good[: len(good) - 100])
    with pytest.raises(GGUFError, match="truncated"):
        read_projector(tmp_path / "cut.gguf")
