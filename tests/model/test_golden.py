"""The golden test: the tiny model, greedy, a pinned output. Every path (CUDA included) must reproduce it."""

from __future__ import annotations

from pathlib import Path

import torch

from webchat.kernels.backend import load_model
from webchat.model.transformer import Transformer

GOLDEN_PROMPT = [1, 20, 30, 40, 50, 60]
# Pinned from the float32 CPU path; a change here is a change in the model's maths.
GOLDEN_GREEDY = [
    250, 173, 355, 335, 496, 420, 483, 41, 41, 41, 41, 41, 41, 44, 337, 443,
    112, 116, 337, 123, 129, 386, 116, 265, 511, 440, 272, 471, 438, 294, 52, 420,
]  # fmt: skip


def greedy(model: Transformer, prompt: list[int], n: int) -> list[int]:
    cache = model.new_cache(len(prompt) + n)
    x, out = prompt, []
    for _ in range(n):
        nxt = int(cache.feed(model, x)[-1].argmax())
        out.append(nxt)
        x = [nxt]
    return out


def test_tiny_model_greedy_output_is_pinned(tiny_model_dir: Path) -> None:
    model = load_model(tiny_model_dir)
    assert greedy(model, GOLDEN_PROMPT, len(GOLDEN_GREEDY)) == GOLDEN_GREEDY


def test_tiny_model_bfloat16_mostly_agrees(tiny_model_dir: Path) -> None:
    # bfloat16 rounds differently; it must still follow the float32 path for the first tokens.
    model = load_model(tiny_model_dir, dtype=torch.bfloat16)
    assert greedy(model, GOLDEN_PROMPT, 4) == GOLDEN_GREEDY[:4]
