"""Prompt logprobs from the engine's own prefill (webchat.engine.engine: a request's prompt_logprobs): each prompt
token's probability, rank and alternatives equal a whole forward's softmax at the position before it, however the
prompt is chunked and whatever else decodes beside it; a prompt may be scored with nothing generated."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from webchat.engine import events as ev
from webchat.engine.engine import Engine
from webchat.engine.generator import Generator
from webchat.engine.sequence import GenerationRequest, StreamResult
from webchat.engine.settings import SamplingSettings
from webchat.kernels.backend import load_model
from webchat.model.kv_cache import SeqCache
from webchat.serve.worker import result_events
from webchat.text.tokenizer import Tokenizer

GREEDY = SamplingSettings(temperature=0.0)


@pytest.fixture(scope="module")
def tiny(tiny_model_dir: Path) -> tuple[Any, Tokenizer]:
    return load_model(tiny_model_dir), Tokenizer.from_dir(tiny_model_dir)


def reference(model: Any, ids: list[int]) -> torch.Tensor:
    """log-softmax of every position's logits from one whole forward: (len(ids), vocab)."""
    cache = SeqCache(model.new_pool(len(ids) + 16))
    return torch.log_softmax(cache.feed(model, ids, all_logits=True).float(), dim=-1)


def drain(gen: Generator) -> tuple[list[ev.TokenInfo] | None, list[StreamResult]]:
    scored, results = None, []
    while True:
        res = gen.stream()
        results.append(res)
        scored = res.prompt if res.prompt is not None else scored
        if res.eos:
            return scored, results


def check(scored: list[ev.TokenInfo], ids: list[int], ref: torch.Tensor, k: int, tok: Tokenizer) -> None:
    assert [t.id for t in scored] == ids
    assert "".join(t.piece for t in scored) == tok.decode(ids)
    assert scored[0].prob is None and scored[0].rank is None  # nothing precedes the first token
    for i in range(1, len(ids)):
        row, t = ref[i - 1], scored[i]
        assert t.prob is not None and t.rank is not None
        assert abs(t.prob - float(row[ids[i]].exp())) < 1e-5, i
        assert t.rank == int((row > row[ids[i]]).sum()) + 1
        top = torch.topk(row, k)
        assert [a for a, _, _ in t.top] == top.indices.tolist()
        assert all(abs(p - q) < 1e-5 for (_, _, p), q in zip(t.top, top.values.exp().tolist(), strict=True))


@pytest.mark.parametrize("chunk", [256, 7])
def test_each_prompt_token_scored_as_a_whole_forward_scores_it(tiny: tuple[Any, Tokenizer], chunk: int) -> None:
    model, tok = tiny
    ids = tok.encode("def add(a, b):\n    return a + b\n\nprint(add(2, 3))  # 5 and some more words to score")
    gen = Generator(model, tok, prefill_chunk=chunk)
    gen.begin_stream(GenerationRequest(prompt_ids=ids, settings=GREEDY, max_new_tokens=4, prompt_logprobs=5))
    scored, results = drain(gen)
    assert scored is not None
    check(scored, ids, reference(model, ids), 5, tok)
    assert sum(r.prompt is not None for r in results) == 1  # once, when the prefill ends
    plain = Generator(model, tok)
    plain.begin_stream(GenerationRequest(prompt_ids=ids, settings=GREEDY, max_new_tokens=4))
    assert [t for r in drain(plain)[1] for t in r.token_ids] == [t for r in results for t in r.token_ids]


def test_a_prompt_scored_with_nothing_generated(tiny: tuple[Any, Tokenizer]) -> None:
    model, tok = tiny
    ids = tok.encode("Hello world, hello world.")
    gen = Generator(model, tok)
    gen.begin_stream(GenerationRequest(prompt_ids=ids, settings=GREEDY, max_new_tokens=0, prompt_logprobs=0))
    scored, results = drain(gen)
    assert scored is not None and all(t.top == [] for t in scored)
    assert results[-1].eos_reason == "max_new_tokens" and not any(r.token_ids for r in results)
    events = result_events(results[-1], tok.id_to_text)
    assert isinstance(events[0], ev.PromptTokens) and isinstance(events[-1], ev.Finished)
    with pytest.raises(ValueError, match="max_new_tokens must be at least 1"):
        Generator(model, tok).begin_stream(GenerationRequest(prompt_ids=ids, max_new_tokens=0))
    with pytest.raises(ValueError, match="prompt_logprobs must be in"):
        Generator(model, tok).begin_stream(GenerationRequest(prompt_ids=ids, prompt_logprobs=21))


def test_scoring_beside_eight_decoding_streams_and_after_a_cached_prefix(tiny: tuple[Any, Tokenizer]) -> None:
    """A scored prompt is computed in mixed steps beside other streams, and a prefix the pool already holds is
    recomputed for it (its rows' logits are wanted), with the same numbers."""
    model, tok = tiny
    engine = Engine(model, tok, mixed_chunk=5)
    others = [Generator(model, tok, engine=engine) for _ in range(8)]
    for i, g in enumerate(others):
        g.begin_stream(GenerationRequest(prompt_ids=tok.encode(f"Stream {i} says"), settings=GREEDY,
                                         max_new_tokens=60, stop_token_ids=[]))
    for g in others:
        g.stream()
    ids = tok.encode("print(add(2, 3)) and then a few more words for the scorer")
    warm = Generator(model, tok, engine=engine)  # puts the prompt's pages in the pool
    warm.begin_stream(GenerationRequest(prompt_ids=ids, settings=GREEDY, max_new_tokens=1))
    drain(warm)
    scorer = Generator(model, tok, engine=engine)
    info = scorer.begin_stream(GenerationRequest(prompt_ids=ids, settings=GREEDY, max_new_tokens=3,
                                                 prompt_logprobs=3))
    assert info.reused_tokens == 0
    scored = None
    while True:
        for g in others:
            g.stream()
        res = scorer.stream()
        scored = res.prompt if res.prompt is not None else scored
        if res.eos:
            break
    assert scored is not None
    check(scored, ids, reference(model, ids), 3, tok)
