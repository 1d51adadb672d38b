"""Grammars as constraints (webchat.engine.grammar) on the engine: a random-weight tiny model emits valid instances
only (the grammar, not the model, makes them so), forced tokens, unsupported keywords named, speculation and
batching change no token, and a Continue (the kept reply replayed into a new matcher) goes on as the reply would."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from grammars import SCHEMAS  # tests/ is on sys.path under pytest

from webchat.engine.engine import Engine
from webchat.engine.generator import Generator
from webchat.engine.sequence import GenerationRequest
from webchat.engine.settings import SamplingSettings
from webchat.engine.spec.verify_cost import VerifyCost
from webchat.grammar import build as g
from webchat.grammar import matcher as gm
from webchat.grammar.bounds import GrammarError
from webchat.kernels.backend import load_model
from webchat.text.tokenizer import Tokenizer

# the four schemas of the issue's acceptance, shared with tests/serve/test_openai_structured.py
SAMPLED = SamplingSettings(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0)


@pytest.fixture(scope="module")
def tiny(tiny_model_dir: Path) -> tuple[Any, Tokenizer]:
    return load_model(tiny_model_dir), Tokenizer.from_dir(tiny_model_dir)


def constraint(tok: Tokenizer, vocab: int, grammar: str) -> gm.GrammarConstraint:
    g.validate(grammar)
    grammars = gm.grammars_for(tok, vocab)
    grammars.check(grammar)
    return grammars.constraint(grammar)


def generate(gen: Generator, req: GenerationRequest) -> tuple[list[int], str, str | None]:
    gen.begin_stream(req)
    ids, text = [], ""
    while True:
        res = gen.stream()
        ids += res.token_ids
        text += res.text
        if res.eos:
            return ids, text, res.eos_reason


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_a_random_model_emits_valid_instances_only(tiny: tuple[Any, Tokenizer], name: str) -> None:
    model, tok = tiny
    schema = SCHEMAS[name]
    grammar = g.json_schema(schema)
    gen = Generator(model, tok)
    prompt = tok.encode_chat([{"role": "user", "content": "Answer in JSON."}])
    for seed in range(6):
        req = GenerationRequest(prompt_ids=prompt, settings=SamplingSettings(**{**SAMPLED.__dict__, "seed": seed}),
                                max_new_tokens=300, constraint=constraint(tok, model.args.vocab_size, grammar))
        _, text, reason = generate(gen, req)
        assert reason == "stop_token", (seed, text)
        jsonschema.validate(json.loads(text), schema)
    free = generate(gen, GenerationRequest(prompt_ids=prompt, settings=SamplingSettings(temperature=1.0, seed=0),
                                           max_new_tokens=40))[1]
    with pytest.raises(ValueError):  # the same model unconstrained writes no JSON at all
        json.loads(free)


@pytest.mark.parametrize(("grammar", "check"), [
    (g.regex(r"[A-Z][a-z]{2,5} [0-9]{1,3}"), lambda t: re.fullmatch(r"[A-Z][a-z]{2,5} [0-9]{1,3}", t)),
    (g.choice(["yes", "no", "maybe later"]), lambda t: t in ("yes", "no", "maybe later")),
    (g.lark('start: "[" NUM ("," NUM)* "]"\nNUM: /[0-9]{1,2}/'), lambda t: re.fullmatch(r"\[\d{1,2}(,\d{1,2})*\]", t)),
], ids=["regex", "choice", "lark"])
def test_regex_choice_object_and_lark(tiny: tuple[Any, Tokenizer], grammar: str, check: Any) -> None:
    model, tok = tiny
    gen = Generator(model, tok)
    for seed in range(4):
        req = GenerationRequest(prompt_ids=tok.encode("Go:"), settings=SamplingSettings(temperature=1.0, seed=seed),
                                max_new_tokens=200, constraint=constraint(tok, model.args.vocab_size, grammar))
        _, text, reason = generate(gen, req)
        assert reason == "stop_token" and check(text), (seed, text)


def test_unsupported_keywords_and_bad_regexes_are_named() -> None:
    with pytest.raises(GrammarError, match=r'Unimplemented keys: \["if"\]'):
        g.validate(g.json_schema({"type": "object", "if": {"type": "object"}}))
    with pytest.raises(GrammarError, match="Unknown format: frobnicate"):
        g.validate(g.json_schema({"type": "string", "format": "frobnicate"}))
    with pytest.raises(GrammarError, match="look-around"):
        g.validate(g.regex("a(?=b)"))


def test_forced_tokens_and_the_mask_follow_the_grammar(tiny: tuple[Any, Tokenizer]) -> None:
    """A schema whose keys are fixed forces them: compute_ff_tokens hands them to the engine, which takes them as
    verify rows (several in a forward), and every emitted token is one the mask allowed."""
    model, tok = tiny
    schema = {"type": "object", "properties": {"a_long_fixed_key_name": {"type": "integer", "minimum": 0,
                                                                         "maximum": 9}},
              "required": ["a_long_fixed_key_name"], "additionalProperties": False,
              "x-guidance": {"whitespace_flexible": False}}
    c = constraint(tok, model.args.vocab_size, g.json_schema(schema))
    gen = Generator(model, tok)
    ids, text, reason = generate(gen, GenerationRequest(prompt_ids=tok.encode("x"), settings=SamplingSettings(
        temperature=0.0), max_new_tokens=60, constraint=c, return_probs=True, top_alts=5))
    assert reason == "stop_token" and re.fullmatch(r'\{"a_long_fixed_key_name":[0-9]\}', text), text
    assert gen.engine.steps < len(ids)  # the forced key came several tokens a step
    assert c.accepted == len(ids)


@pytest.mark.parametrize("settings", [SamplingSettings(temperature=0.0), SAMPLED], ids=["greedy", "sampled"])
def test_speculative_modes_give_the_same_tokens_under_a_grammar(tiny_model_dir: Path,
                                                                settings: SamplingSettings) -> None:
    model, tok = load_model(tiny_model_dir), Tokenizer.from_dir(tiny_model_dir)
    draft = load_model(tiny_model_dir)
    vocab = model.args.vocab_size
    grammar = g.json_schema(SCHEMAS["nested_lengths"])
    prompt = tok.encode('{"user": {"first": "Ann", "address": {"city": "Paris"}}}\n')

    def req(mode: str) -> GenerationRequest:
        return GenerationRequest(prompt_ids=prompt, settings=SamplingSettings(**{**settings.__dict__, "seed": 3}),
                                 max_new_tokens=120, constraint=constraint(tok, vocab, grammar), speculative=mode)

    alone = generate(Generator(model, tok), req("none"))
    engine = Engine(model, tok, draft_model=draft)
    for mode in ("ngram", "self", "draft"):
        assert generate(Generator(model, tok, engine=engine), req(mode))[:2] == alone[:2], mode
    jsonschema.validate(json.loads(alone[1]), SCHEMAS["nested_lengths"])
    # auto, granted every draft it offers (a flat cost): its drafts verified under the grammar's masks, the keys the
    # grammar forces fed as forced rows, never planned nor counted as drafts
    engine.auto.cost = VerifyCost.flat()
    gen, auto = Generator(model, tok, engine=engine), req("auto")
    c = auto.constraint
    assert isinstance(c, gm.GrammarConstraint)
    forced: list[int] = []

    def recorded() -> list[int]:
        tokens = gm.GrammarConstraint.forced(c)
        forced.extend(tokens)
        return tokens

    c.forced = recorded  # type: ignore[method-assign]
    gen.begin_stream(auto)
    ids: list[int] = []
    while not (res := gen.stream()).eos:
        ids += res.token_ids
    ids += res.token_ids
    assert ids == alone[0]
    assert res.stats is not None and res.stats.drafted > 0
    assert forced and res.stats.drafted == sum(engine.auto.counts.drafted.values())  # no forced token counted


def test_continue_replays_the_kept_reply_and_keeps_the_constraint(tiny: tuple[Any, Tokenizer]) -> None:
    """A branch or Continue: the kept tokens replayed into a new matcher, the prompt + kept tokens fed, the reply goes
    on exactly as the whole reply did (greedy), and a kept reply that breaks the grammar is refused."""
    model, tok = tiny
    vocab = model.args.vocab_size
    grammar = g.json_schema(SCHEMAS["flat_minimum"])
    prompt = tok.encode_chat([{"role": "user", "content": "Who?"}])
    whole, text, _ = generate(Generator(model, tok), GenerationRequest(
        prompt_ids=prompt, settings=SamplingSettings(temperature=0.0), max_new_tokens=200,
        constraint=constraint(tok, vocab, grammar)))
    jsonschema.validate(json.loads(text), SCHEMAS["flat_minimum"])
    for k in (1, len(whole) // 2, len(whole) - 1):
        c = constraint(tok, vocab, grammar)
        c.replay(whole[:k])
        rest, _, reason = generate(Generator(model, tok), GenerationRequest(
            prompt_ids=prompt + whole[:k], settings=SamplingSettings(temperature=0.0), max_new_tokens=200,
            constraint=c))
        assert whole[:k] + rest == whole and reason == "stop_token", k
    with pytest.raises(Exception, match="does not follow the reply's format"):
        constraint(tok, vocab, grammar).replay(tok.encode("Hello"))
