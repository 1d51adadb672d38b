"""An image's slots in the C++ forward (csrc/qstep.cpp) against the PyTorch path: given embedding rows in place of the
token lookup, and per-row key ends (an image's slots attending to each other both ways, Gemma 3), with and without a
sliding window, on every code path this CPU runs."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from webchat.kernels.backend import load_model
from webchat.kernels.cpu import build as qkernels
from webchat.kernels.cpu.step import CpuStep
from webchat.model.batch import Placed, make_batch
from webchat.model.kv_cache import PageTable
from webchat.model.transformer import Transformer

PAGE = 16
PROMPT = [5 + i % 200 for i in range(40)]
RUN = (10, 30)  # the image's slots: positions 10..29


@pytest.fixture(autouse=True)
def _needs_kernels(kernels: object) -> None:
    """Every test here runs the C++ forward (conftest's `kernels` skips them all without a toolchain)."""


@pytest.fixture(params=qkernels.PATHS)
def code_path(request: pytest.FixtureRequest, kernels: object) -> Iterator[str]:
    if request.param not in qkernels.available_paths():
        pytest.skip(f"this CPU cannot run the {request.param} path")
    qkernels.load().set_path(qkernels.PATHS[request.param])
    yield request.param
    qkernels.load().set_path(-1)


def placed(dim: int, both_ways: bool) -> Placed:
    rows = torch.randn(RUN[1] - RUN[0], dim, generator=torch.Generator().manual_seed(3))
    ends = [p + 1 for p in range(len(PROMPT))]
    if both_ways:
        ends[RUN[0] : RUN[1]] = [RUN[1]] * (RUN[1] - RUN[0])
    return Placed(list(range(*RUN)), rows, ends if both_ways else None)


def logits(model: Transformer, image: Placed | None, cpp: bool) -> torch.Tensor:
    """Every prompt row's logits, the prompt in one chunk, by the C++ step or the PyTorch path."""
    pool = model.new_pool(4 * PAGE, PAGE)
    table = PageTable(pool)
    table.ensure(len(PROMPT))
    batch = make_batch([(PROMPT, 0, table.pages, list(range(len(PROMPT))))], PAGE, placed=[image])
    runner = model.runner
    model.runner = runner if cpp else None
    try:
        return model(batch, pool)
    finally:
        model.runner = runner


def windowed(model: Transformer, window: int) -> Transformer:
    """The model with every layer's attention over a sliding window, its C++ step rebuilt for it."""
    model.args = dataclasses.replace(model.args, layer_windows=tuple(window for _ in model.layers))
    for layer in model.layers:
        layer.attention.window = window  # type: ignore[union-attr]
    model.runner = CpuStep(model, qkernels.load())
    return model


@pytest.mark.parametrize("window", [0, 12])
def test_image_rows_and_key_ends_in_cpp_are_the_pytorch_paths(tiny_model_dir: Path, code_path: str,
                                                              window: int) -> None:
    model = load_model(tiny_model_dir)
    assert isinstance(model.runner, CpuStep)
    if window:
        model = windowed(model, window)
    text = logits(model, None, cpp=True)
    for both_ways in (False, True):
        image = placed(model.args.dim, both_ways)
        ours, ref = logits(model, image, cpp=True), logits(model, image, cpp=False)
        torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)
        # the rows before the image are the text's; from the image on they are not (its rows went in)
        torch.testing.assert_close(ours[: RUN[0]], text[: RUN[0]], atol=1e-5, rtol=1e-5)
        assert (ours[RUN[0]] - text[RUN[0]]).abs().max() > 1e-2
    causal, both = logits(model, placed(model.args.dim, False), True), logits(model, placed(model.args.dim, True), True)
    # both ways: a slot sees the slots after it, so every slot but the last changes; rows past the run see all anyway
    # and still differ (their past did); before the run nothing changes
    assert torch.equal(causal[: RUN[0]], both[: RUN[0]])
    assert (causal[RUN[0] : RUN[1] - 1] - both[RUN[0] : RUN[1] - 1]).abs().amax(-1).min() > 1e-4


def test_key_ends_outside_the_sequence_are_refused(tiny_model_dir: Path) -> None:
    model = load_model(tiny_model_dir)
    image = placed(model.args.dim, True)
    assert image.key_ends is not None
    image.key_ends[RUN[0]] = len(PROMPT) + 5  # past the batch's last row: k/v not written yet
    with pytest.raises(RuntimeError, match=r"key_ends\[10\] = 45 must be in \[11, 40\]"):
        logits(model, image, cpp=True)
    with pytest.raises(ValueError, match="needs one value per new token"):
        make_batch([(PROMPT, 0, [1, 2, 3], [-1])], PAGE, placed=[Placed([0], torch.zeros(1, model.args.dim), [1])])
