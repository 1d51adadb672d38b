"""A prompt's chunk bounded in time (webchat.engine.chunking): a step's cost fitted as fixed + per row, the chunk
sized from it while others decode or alone, never below a floor, in a handful of sizes; and the output the same
however the prompt was chunked."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from test_engine import GREEDY, prompts, run_alone, run_together  # tests/engine is on sys.path under pytest

from webchat.engine import engine as engine_module
from webchat.engine.chunking import StepCost
from webchat.engine.engine import (
    MIN_CHUNK,
    MIXED_CHUNK,
    MIXED_STEP_S,
    PREFILL_CHUNK,
    PREFILL_MIN,
    PREFILL_STEP_S,
    Engine,
)
from webchat.engine.generator import Generator
from webchat.engine.sequence import GenerationRequest
from webchat.kernels.backend import load_model
from webchat.text.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tiny(tiny_model_dir: Path) -> tuple[Any, Tokenizer]:
    return load_model(tiny_model_dir), Tokenizer.from_dir(tiny_model_dir)


def test_the_line_keeps_a_steps_fixed_part_apart_from_its_rows() -> None:
    cost = StepCost()
    assert cost.line() is None and cost.rows_within(0.2) is None
    for rows in (32, 16, 8, 16, 32):
        cost.add(rows, 0.110 + 0.003 * rows)  # a scored prompt's steps: 110 ms whatever the rows, 3 ms a row
    fixed, per = cost.line()  # type: ignore[misc]
    assert fixed == pytest.approx(0.110) and per == pytest.approx(0.003)
    assert cost.rows_within(0.2) in (29, 30)  # (0.2 - 0.11) / 0.003: time / rows would have said 0.2 / 0.0137 = 14
    assert cost.rows_within(0.05) == 0  # the fixed part alone is over


def test_one_row_count_or_a_bent_line_counts_everything_per_row() -> None:
    cost = StepCost()
    cost.add(32, 0.32)
    assert cost.line() == (0.0, pytest.approx(0.01))
    bent = StepCost()
    bent.add(8, 0.5)  # a step the machine stalled
    bent.add(32, 0.1)
    assert bent.line() == (0.0, pytest.approx(0.6 / 40))  # a negative slope is noise, not a cost
    only_recent = StepCost(window=2)
    for rows, s in ((8, 9.0), (16, 0.16), (32, 0.32)):
        only_recent.add(rows, s)
    assert only_recent.line() == (pytest.approx(0.0, abs=1e-12), pytest.approx(0.01))  # the oldest step forgotten


def test_the_chunk_follows_the_measured_cost_in_powers_of_two(tiny: tuple[Any, Tokenizer]) -> None:
    model, tok = tiny
    engine = Engine(model, tok, max_seq_len=256)
    assert engine._chunk_budget(0, False) == PREFILL_CHUNK and engine._chunk_budget(1, False) == MIXED_CHUNK
    engine.step_cost[False].add(32, 0.032)  # 1 ms a row: 200 rows fit in 0.2 s
    assert engine._chunk_budget(1, False) == MIXED_CHUNK
    assert engine._chunk_budget(0, False) == PREFILL_CHUNK  # 1,000 rows would fit in a second
    engine.step_cost[False] = StepCost()
    engine.step_cost[False].add(32, 32 * PREFILL_STEP_S / 35)  # a big model deep in a long prompt
    assert engine._chunk_budget(0, False) == PREFILL_MIN  # 35 rows fit in a step alone: it keeps its floor, not 32
    assert engine._chunk_budget(1, False) == 16  # beside a stream the time bound holds: 21 rows fit, the 16 under them
    engine.step_cost[False] = StepCost()
    engine.step_cost[False].add(32, 32 * PREFILL_STEP_S / 125)  # 125 rows fit alone: 128, not the 64 under it
    assert engine._chunk_budget(0, False) == 128
    engine.step_cost[False] = StepCost()
    engine.step_cost[False].add(32, 32 * MIXED_STEP_S / 31)  # 30 rows fit beside a stream: the 16 under it
    assert engine._chunk_budget(1, False) == 16
    engine.step_cost[False] = StepCost()
    engine.step_cost[False].add(32, 32 * MIXED_STEP_S / 3)
    assert engine._chunk_budget(1, False) == MIN_CHUNK  # 3 rows fit beside a stream: never below the floor
    assert engine._chunk_budget(1, True) == MIXED_CHUNK  # a scored prompt's steps are timed apart
    engine.step_cost[True].add(16, 10.0)  # nothing fits at all: the floor, not a failure
    assert engine._chunk_budget(1, True) == MIN_CHUNK and engine._chunk_budget(0, True) == PREFILL_MIN
    small = Engine(model, tok, max_seq_len=256, prefill_chunk=16)  # a chunk set under the floor bounds it
    small.step_cost[False].add(32, 10.0)
    assert small._chunk_budget(0, False) == 16


def test_a_prompt_chunked_to_the_floor_beside_a_stream_gives_the_same_tokens(tiny: tuple[Any, Tokenizer],
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    model, tok = tiny
    short = prompts(1, model.args.vocab_size, seed=5)[0]
    long_prompt = [(7 * i + 3) % model.args.vocab_size for i in range(400)]
    reqs = [GenerationRequest(prompt_ids=short[:8], settings=GREEDY, max_new_tokens=40, stop_token_ids=[]),
            GenerationRequest(prompt_ids=long_prompt, settings=GREEDY, max_new_tokens=6, stop_token_ids=[],
                              prompt_logprobs=1)]
    alone = [run_alone(Generator(model, tok, max_seq_len=512), r) for r in reqs]
    monkeypatch.setattr(engine_module, "MIXED_STEP_S", 1e-9)  # every timed step is too long: chunks at the floor
    monkeypatch.setattr(engine_module, "PREFILL_STEP_S", 1e-9)
    engine = Engine(model, tok, max_seq_len=512, pool_tokens=2048)
    chunks: list[int] = []
    step = engine._forward

    def recorded(rows: list[Any]) -> None:
        chunks.extend(len(r.feed) for r in rows if r.seq.prefilling and r.seq.req.prompt_logprobs is not None)
        step(rows)

    monkeypatch.setattr(engine, "_forward", recorded)
    together = run_together([Generator(model, tok, engine=engine) for _ in reqs], reqs)
    assert together == alone
    assert chunks[0] > MIXED_CHUNK  # the first step, both prompts together, before any step was timed
    assert set(chunks[1:-1]) == {MIN_CHUNK} and len(chunks) > 10, chunks  # then the floor, each step
