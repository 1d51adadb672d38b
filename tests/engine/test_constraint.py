"""The engine's constraint seam (webchat.engine.constraint): every emitted token is one the constraint allowed, forced
tokens come without a forward each, forbidden alternatives are marked, and a constraint changes nothing about
exactness: speculative modes and batching give the same tokens as a lone stream without speculation."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from webchat.engine import constraint as cst
from webchat.engine.engine import Engine
from webchat.engine.generator import Generator
from webchat.engine.sequence import GenerationRequest, StreamResult
from webchat.engine.settings import SamplingSettings
from webchat.engine.spec.verify_cost import VerifyCost
from webchat.kernels.backend import load_model
from webchat.text.tokenizer import Tokenizer

GREEDY = SamplingSettings(temperature=0.0)
SEEDED = SamplingSettings(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=7)


@pytest.fixture(scope="module")
def tiny(tiny_model_dir: Path) -> tuple[Any, Tokenizer]:
    return load_model(tiny_model_dir), Tokenizer.from_dir(tiny_model_dir)


class Cycle:
    """A toy grammar: position i of the reply may be any of sets[i % len(sets)]; `forced_runs` positions (by index
    in the reply) allow one token only and say so through forced(). Records what it was told."""

    def __init__(self, vocab: int, sets: list[list[int]], single: dict[int, int] | None = None) -> None:
        self.vocab, self.sets, self.single = vocab, sets, single or {}
        self.accepted: list[int] = []
        self.masks = 0

    def allowed_now(self) -> list[int]:
        i = len(self.accepted)
        return [self.single[i]] if i in self.single else self.sets[i % len(self.sets)]

    def mask(self, bits: torch.Tensor) -> bool:
        self.masks += 1
        bits.copy_(cst.only(self.allowed_now(), self.vocab))
        return True

    def forced(self) -> list[int]:
        out, i = [], len(self.accepted)
        while i in self.single:
            out.append(self.single[i])
            i += 1
        return out

    def accept(self, token: int) -> None:
        if token not in self.allowed_now():
            raise cst.ConstraintError(f"token {token} not allowed at {len(self.accepted)}")
        self.accepted.append(token)


def run(gen: Generator, req: GenerationRequest) -> tuple[list[int], list[StreamResult]]:
    gen.begin_stream(req)
    ids, results = [], []
    while True:
        res = gen.stream()
        results.append(res)
        ids += res.token_ids
        if res.eos:
            return ids, results


def sets_for(vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [sorted(set(torch.randint(20, vocab, (n,), generator=g).tolist())) for n in (3, 40, 1, 7)]


def test_the_mask_bits_round_trip() -> None:
    bits = cst.only([0, 31, 32, 63, 100], 101)
    assert bits.dtype == torch.int32 and bits.shape == (4,)
    assert cst.allowed(bits, 101).nonzero().flatten().tolist() == [0, 31, 32, 63, 100]
    assert cst.allows(bits, 31) and not cst.allows(bits, 30)
    row = torch.zeros(101)
    cst.apply(row, bits)
    assert torch.isinf(row).sum() == 96 and row[63] == 0
    with pytest.raises(ValueError, match="token id must be in"):
        cst.only([101], 101)


@pytest.mark.parametrize("settings", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_every_token_is_one_the_constraint_allowed(tiny: tuple[Any, Tokenizer], settings: SamplingSettings) -> None:
    model, tok = tiny
    vocab = model.args.vocab_size
    c = Cycle(vocab, sets_for(vocab))
    ids, results = run(Generator(model, tok), GenerationRequest(
        prompt_ids=tok.encode("Hello there"), settings=settings, max_new_tokens=24, stop_token_ids=[],
        constraint=c, return_probs=True, top_alts=10))
    assert len(ids) == 24
    assert ids == c.accepted  # told every emitted token, in order
    for i, t in enumerate(ids):
        assert t in c.sets[i % len(c.sets)]
    free = run(Generator(model, tok), GenerationRequest(prompt_ids=tok.encode("Hello there"), settings=settings,
                                                       max_new_tokens=24, stop_token_ids=[]))[0]
    assert free != ids  # the constraint, not the model, made them so


def test_forbidden_alternatives_are_marked_with_the_models_probability(tiny: tuple[Any, Tokenizer]) -> None:
    model, tok = tiny
    vocab = model.args.vocab_size
    c = Cycle(vocab, sets_for(vocab))
    _, results = run(Generator(model, tok), GenerationRequest(
        prompt_ids=tok.encode("Hello there"), settings=GREEDY, max_new_tokens=12, stop_token_ids=[], constraint=c,
        return_probs=True, top_alts=20))
    tokens = [t for r in results for t in r.tokens]
    assert tokens and any(t.forbidden for t in tokens)
    for i, t in enumerate(tokens):
        allowed = c.sets[i % len(c.sets)]
        assert t.forbidden == [a for a, _, _ in t.top if a not in allowed]
        assert t.sampled_prob is not None and t.prob is not None
        assert t.sampled_prob >= t.prob - 1e-6  # the mask moved mass onto the allowed tokens


def test_forced_tokens_are_verified_in_one_forward(tiny: tuple[Any, Tokenizer]) -> None:
    """Positions the grammar decides alone are fed as verify rows: the reply comes in fewer steps, and each forced
    token still carries the model's own probability."""
    model, tok = tiny
    vocab = model.args.vocab_size
    single = {i: 30 + i for i in range(2, 9)}  # positions 2..8 forced
    prompt = tok.encode("Forced run")
    gen = Generator(model, tok)
    c = Cycle(vocab, sets_for(vocab, 1), single)
    ids, results = run(gen, GenerationRequest(prompt_ids=prompt, settings=GREEDY, max_new_tokens=12,
                                              stop_token_ids=[], constraint=c, return_probs=True, top_alts=3))
    assert ids[2:9] == [30 + i for i in range(2, 9)]
    steps = gen.engine.steps
    # the same tokens one step each: a constraint with the same masks that reports nothing forced
    quiet = Cycle(vocab, sets_for(vocab, 1), single)
    quiet.forced = lambda: []  # type: ignore[method-assign]
    gen2 = Generator(model, tok)
    ids2, _ = run(gen2, GenerationRequest(prompt_ids=prompt, settings=GREEDY, max_new_tokens=12, stop_token_ids=[],
                                          constraint=quiet))
    assert ids2 == ids
    assert steps < gen2.engine.steps - 4
    tokens = [t for r in results for t in r.tokens]
    assert all(t.prob is not None and 0.0 < t.prob <= 1.0 for t in tokens)
    last = results[-1].stats
    assert last is not None and last.drafted == 0 and last.accepted == 0  # forced tokens are not speculation


@pytest.mark.parametrize("settings", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_speculation_and_batching_keep_a_constrained_output(tiny_model_dir: Path,
                                                            settings: SamplingSettings) -> None:
    model, tok = load_model(tiny_model_dir), Tokenizer.from_dir(tiny_model_dir)
    draft = load_model(tiny_model_dir)
    vocab = model.args.vocab_size
    prompt = tok.encode("def add(a, b):\n    return a + b\n\ndef add(a, b):")
    single = {5: 40, 6: 41}

    def req(mode: str) -> GenerationRequest:
        return GenerationRequest(prompt_ids=prompt, settings=settings, max_new_tokens=20, stop_token_ids=[],
                                 constraint=Cycle(vocab, sets_for(vocab, 2), single), speculative=mode)

    alone = run(Generator(model, tok), req("none"))[0]
    engine = Engine(model, tok, draft_model=draft)
    engine.auto.cost = VerifyCost.flat()  # auto grants every draft it is offered: every step verifies
    for mode in ("ngram", "self", "draft", "auto"):
        assert run(Generator(model, tok, engine=engine), req(mode))[0] == alone, mode
    # among other streams, one of them constrained too
    gens = [Generator(model, tok, engine=engine) for _ in range(3)]
    reqs = [req("ngram"), GenerationRequest(prompt_ids=tok.encode("Other text"), settings=GREEDY, max_new_tokens=30,
                                            speculative="auto"), req("auto")]
    for g, r in zip(gens, reqs, strict=True):
        g.begin_stream(r)
    outs: list[list[int]] = [[], [], []]
    done = [False] * 3
    while not all(done):
        for i, g in enumerate(gens):
            if not done[i]:
                res = g.stream()
                outs[i] += res.token_ids
                done[i] = res.eos
    assert outs[0] == alone and outs[2] == alone


@pytest.mark.parametrize("where", ["accept", "mask", "forced"])
def test_a_constraint_that_cannot_go_on_ends_its_own_sequence_and_no_other(tiny: tuple[Any, Tokenizer],
                                                                            where: str) -> None:
    """A grammar that fails (refuses the token it allowed, or its mask or forced tokens raise) ends its sequence with
    the error; another sequence stepped in the same forwards gets every token it gets alone."""
    model, tok = tiny

    class Liar(Cycle):
        def mask(self, bits: torch.Tensor) -> bool:
            if where == "mask" and self.accepted:
                raise cst.ConstraintError("the mask failed")
            return super().mask(bits)

        def forced(self) -> list[int]:
            if where == "forced" and self.accepted:
                raise cst.ConstraintError("the forced tokens failed")
            return super().forced()

        def accept(self, token: int) -> None:
            if where == "accept":
                raise cst.ConstraintError(f"refused {token}")
            super().accept(token)

    other = GenerationRequest(prompt_ids=tok.encode("Other text"), settings=GREEDY, max_new_tokens=12)
    alone, _ = run(Generator(model, tok), other)
    engine = Engine(model, tok, pool_tokens=512)
    liar, bystander = Generator(model, tok, engine=engine), Generator(model, tok, engine=engine)
    liar.begin_stream(GenerationRequest(prompt_ids=tok.encode("Hi"), settings=GREEDY, max_new_tokens=8,
                                        constraint=Liar(model.args.vocab_size, [[50, 51]])))
    bystander.begin_stream(other)
    failed, got, done = None, [], False
    while not done or failed is None:
        if failed is None:
            res = liar.stream()
            if res.eos:
                failed = res
        if not done:
            res = bystander.stream()
            got += res.token_ids
            done = res.eos
    assert failed.eos_reason == "error" and failed.error is not None
    assert failed.error[0] == "grammar" and ("refused 5" if where == "accept" else f"the {where}") in failed.error[1]
    assert got == alone
