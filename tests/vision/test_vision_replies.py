"""A reply about an image against transformers (issue 61's acceptance, on the mini fixtures): a 2048 x 512 image
(SmolVLM: 5 tiles, 320 image tokens; Gemma 3: 256) through the request path and the engine gives the processor's prompt
ids, transformers' first-token top 5 with each probability within 1e-3, and its 16 greedy tokens; however the prefill
is chunked and whichever forward (the C++ step or the PyTorch path) runs the image's rows. bench/vision_fidelity.py
prints the same figures on the full-size fixtures."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from bench import vision_fidelity as vf

TOKENS = 16
IMAGE_TOKENS = {"idefics3": 320, "gemma3": 256}


@pytest.fixture(scope="module")
def references(fixtures: dict[str, Any]) -> dict[str, vf.Reference]:
    return {kind: vf.reference(fx.hf_dir, vf.picture(), vf.PROMPT, TOKENS) for kind, fx in fixtures.items()}


@pytest.fixture(scope="module", params=["idefics3", "gemma3"])
def family(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="module")
def exact(fixtures: dict[str, Any], family: str) -> Iterator[Any]:
    yield vf.runtime(fixtures[family], "exact")


def check(rt: Any, family: str, ref: vf.Reference, bound: float = 1e-3) -> vf.Served:
    rt.local()[2].reset()  # a cold cache: the image encoded and prefilled again
    ours = vf.served(rt, vf.picture(), vf.PROMPT, TOKENS)
    f = vf.compare(ours, ref)
    assert f.same_ids and f.prompt_tokens[0] == f.prompt_tokens[1]
    assert ours.image_tokens == IMAGE_TOKENS[family]
    assert f.top5_same, (ours.top, ref.first.topk(5))
    assert f.max_dp <= bound
    assert f.greedy_same == TOKENS, (ours.greedy, ref.greedy)
    return ours


def test_an_image_reply_is_transformers(exact: Any, family: str, references: dict[str, vf.Reference]) -> None:
    ours = check(exact, family, references[family])
    assert ours.encode_ms > 0


def test_a_prefill_in_small_chunks_keeps_each_run_of_slots_whole(exact: Any, family: str,
                                                                 references: dict[str, vf.Reference],
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """A 24-token chunk budget: each image run (64 or 256 slots) still goes in one chunk, and the reply is the same."""
    engine, forward = exact.local()[2], exact.model.forward
    chunks: list[int] = []

    def counted(batch: Any, pool: Any) -> Any:
        chunks.append(batch.num_tokens)
        return forward(batch, pool)

    monkeypatch.setattr(exact.model, "forward", counted)
    monkeypatch.setattr(engine, "prefill_chunk", 24)
    check(exact, family, references[family])
    assert max(chunks) == (64 if family == "idefics3" else 256)  # a whole run, past the budget
    assert len([c for c in chunks if c > 1]) >= 3  # text before the image in its own chunk, the run, the rest


def test_the_cpp_step_runs_the_image_rows(exact: Any, family: str, references: dict[str, vf.Reference],
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Every prefill chunk through the C++ forward (its row limit raised): its image rows and key ends too."""
    from webchat.kernels.cpu import step

    runner = exact.model.runner
    if not isinstance(runner, step.CpuStep):
        pytest.skip("the C++ step is not this model's runner here")
    monkeypatch.setattr(step, "MAX_ROWS", 4096)
    calls = runner.calls
    check(exact, family, references[family])
    prefill = {"idefics3": 2, "gemma3": 3}[family]  # chunks of 256 that end before a run, or after it
    assert runner.calls - calls == prefill + TOKENS - 1


def test_the_int8_path_stays_close(fixtures: dict[str, Any], family: str, references: dict[str, vf.Reference]) -> None:
    """Q8_0 weights with int8 activations and the int8 encoder (measured max |dp| 1.7e-6 and 1.9e-4 here)."""
    check(vf.runtime(fixtures[family], "int8"), family, references[family], bound=2e-3)
