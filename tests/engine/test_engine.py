"""The batched engine: output alone equals output among many (greedy, seeded, speculative), logits of a ragged batch
equal single-sequence logits, prefix pages are shared, and a small pool queues requests without failing any."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from test_fidelity import PROMPTS as FIDELITY_PROMPTS  # tests/ is on sys.path under pytest

from webchat.engine import events as ev
from webchat.engine.engine import Engine
from webchat.engine.generator import Generator
from webchat.engine.sequence import GenerationRequest
from webchat.engine.settings import SamplingSettings
from webchat.engine.spec.verify_cost import VerifyCost
from webchat.kernels.backend import load_model
from webchat.model.batch import make_batch
from webchat.model.kv_cache import KVPool, SeqCache
from webchat.serve.backend import Job
from webchat.serve.worker import Worker
from webchat.text.tokenizer import Tokenizer

GREEDY = SamplingSettings(temperature=0.0)
MODES = ["none", "ngram", "self", "draft", "auto"]


@pytest.fixture(scope="module")
def tiny(tiny_model_dir: Path) -> tuple[Any, Tokenizer]:
    return load_model(tiny_model_dir), Tokenizer.from_dir(tiny_model_dir)


@pytest.fixture(scope="module")
def draft(tiny_model_dir: Path) -> Any:
    return load_model(tiny_model_dir)  # same weights: drafts get accepted, so the acceptance path runs


def prompts(n: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """n prompts of mixed lengths (3 to 300 tokens; some longer than a prefill chunk), repetitive enough for n-grams."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        length = [3, 17, 40, 300, 90, 8, 150, 33][i % 8]
        base = torch.randint(3, vocab, (max(2, length // 3),), generator=g).tolist()
        out.append(([1] + base * 4)[:length])
    return out


def same_length(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [[1, *torch.randint(3, vocab, (length - 1,), generator=g).tolist()] for _ in range(n)]


def run_together(gens: list[Generator], reqs: list[GenerationRequest]) -> list[list[int]]:
    """Drive every handle round-robin, as the worker does: each stream() steps the shared engine at most once."""
    for gen, req in zip(gens, reqs, strict=True):
        gen.begin_stream(req)
    out: list[list[int]] = [[] for _ in gens]
    done = [False] * len(gens)
    while not all(done):
        for i, gen in enumerate(gens):
            if not done[i]:
                res = gen.stream()
                out[i] += res.token_ids
                done[i] = res.eos
    return out


def run_alone(gen: Generator, req: GenerationRequest) -> list[int]:
    return run_together([gen], [req])[0]


def with_costs(engine: Engine, costs: str) -> Engine:
    """costs "flat": the auto mode grants every draft it is offered (every step verifies); "measured": it plans by
    what verify rows cost on this machine, as served."""
    if costs == "flat":
        engine.auto.cost = VerifyCost.flat()
    return engine


@pytest.mark.parametrize("costs", ["measured", "flat"])
def test_greedy_alone_equals_greedy_among_sixteen_mixed_sequences(tiny: tuple[Any, Tokenizer], draft: Any,
                                                                  costs: str) -> None:
    model, tok = tiny
    ps = prompts(16, model.args.vocab_size)
    reqs = [GenerationRequest(prompt_ids=p, settings=GREEDY, max_new_tokens=24 + 3 * (i % 5), stop_token_ids=[],
                              speculative=MODES[i % 5]) for i, p in enumerate(ps)]  # fmt: skip
    engine = with_costs(Engine(model, tok, max_seq_len=512, pool_tokens=16 * 512, draft_model=draft,
                               self_draft_layers=1), costs)
    together = run_together([Generator(model, tok, engine=engine) for _ in reqs], reqs)
    assert engine.steps < sum(len(t) for t in together)  # many sequences advanced per forward
    for i, req in enumerate(reqs):
        plain = GenerationRequest(prompt_ids=req.prompt_ids, settings=GREEDY, max_new_tokens=req.max_new_tokens,
                                  stop_token_ids=[])  # fmt: skip
        alone = run_alone(Generator(model, tok, max_seq_len=512), plain)
        assert together[i] == alone, f"sequence {i} ({req.speculative}, {len(req.prompt_ids)} prompt tokens)"


@pytest.mark.parametrize("costs", ["measured", "flat"])
def test_seeded_sampling_alone_equals_batched(tiny: tuple[Any, Tokenizer], draft: Any, costs: str) -> None:
    model, tok = tiny
    ps = prompts(10, model.args.vocab_size, seed=1)
    reqs = [GenerationRequest(prompt_ids=p, settings=SamplingSettings(temperature=0.9, seed=100 + i),
                              max_new_tokens=20, stop_token_ids=[], speculative=MODES[i % 5], return_probs=True)
            for i, p in enumerate(ps)]  # fmt: skip
    engine = with_costs(Engine(model, tok, max_seq_len=512, pool_tokens=10 * 512, draft_model=draft,
                               self_draft_layers=1), costs)
    together = run_together([Generator(model, tok, engine=engine) for _ in reqs], reqs)
    for i, req in enumerate(reqs):
        plain = GenerationRequest(prompt_ids=req.prompt_ids, settings=req.settings, max_new_tokens=20,
                                  stop_token_ids=[], return_probs=True)
        alone = run_alone(Generator(model, tok, max_seq_len=512), plain)
        assert together[i] == alone, f"seeded sequence {i} ({req.speculative})"


def test_ragged_batch_logits_equal_single_sequence_logits(tiny: tuple[Any, Tokenizer]) -> None:
    # one forward over 16 sequences, each partly cached: prefill chunks, single decode tokens, verify-like runs
    model, _ = tiny
    ps = prompts(16, model.args.vocab_size, seed=2)
    pool = model.new_pool(16 * 320)
    caches, spec, want = [], [], []
    for i, p in enumerate(ps):
        cut = [len(p) - 1, 0, len(p) // 2, max(0, len(p) - 5)][i % 4]  # tokens already in the cache
        cache = model.new_cache(320)
        if cut:
            cache.feed(model, p[:cut])
        want.append(cache.feed(model, p[cut:], all_logits=True))  # (len(p) - cut, vocab) alone
        mine = SeqCache(pool)
        if cut:
            mine.feed(model, p[:cut])
        mine.table.ensure(len(p))
        caches.append(mine)
        spec.append((p[cut:], cut, mine.table.pages, list(range(len(p) - cut))))
    got = model(make_batch(spec, pool.page_size), pool)
    torch.testing.assert_close(got, torch.cat(want), atol=1e-4, rtol=0)


def test_a_copied_page_holds_its_source_in_every_layer_and_is_its_own(tiny: tuple[Any, Tokenizer]) -> None:
    """The copy on write of a shared or partial page (one op over the pool's stacked layers)."""
    model, _ = tiny
    pool = KVPool(model.args, 4, "cpu", torch.float32, 16)
    assert len(pool.k) == len(pool.v) == model.args.n_layers
    assert all(not t[0].any() for t in pool.k + pool.v)  # the padding page holds zeros, never NaN
    src = pool.alloc()
    for t in pool.k + pool.v:
        t[src].normal_()
    dst = pool.copy(src)
    assert dst not in (0, src)
    assert all(torch.equal(t[dst], t[src]) for t in pool.k + pool.v)
    pool.v[-1][dst].zero_()
    assert pool.v[-1][src].any() and all(torch.equal(t[dst], t[src]) for t in pool.k)


def test_identical_prefixes_are_computed_once(tiny: tuple[Any, Tokenizer]) -> None:
    model, tok = tiny
    counted: list[int] = []

    def counting(batch: Any, kv: Any) -> torch.Tensor:
        counted.append(int(batch.tokens.shape[0]))
        return model(batch, kv)  # type: ignore[no-any-return]

    counting.args, counting.device, counting.dtype = model.args, model.device, model.dtype  # type: ignore[attr-defined]
    counting.new_pool, counting.ensure_rope = model.new_pool, model.ensure_rope  # type: ignore[attr-defined]
    counting.truncated, counting.sampler_factory = model.truncated, None  # type: ignore[attr-defined]
    counting.row_scan, counting.suffix_index = model.row_scan, model.suffix_index  # type: ignore[attr-defined]
    engine = Engine(counting, tok, max_seq_len=256, pool_tokens=4096)  # type: ignore[arg-type]
    system = prompts(4, model.args.vocab_size, seed=3)[3][:100]
    first = run_alone(Generator(model, tok, engine=engine),
                      GenerationRequest(prompt_ids=system + [5, 6], settings=GREEDY, max_new_tokens=4))
    fed_first = sum(counted)
    counted.clear()
    other = Generator(model, tok, engine=engine)
    info = other.begin_stream(GenerationRequest(prompt_ids=system + [7, 8, 9], settings=GREEDY, max_new_tokens=4))
    assert info.reused_tokens == 96  # the 6 whole pages of the shared opening (page size 16)
    while not other.stream().eos:
        pass
    assert sum(counted) == len(system) + 3 - 96 + 3 < fed_first
    assert first  # the first turn produced tokens


def test_each_row_is_marked_prompt_or_not(tiny: tuple[Any, Tokenizer]) -> None:
    """Every batch tells the forward where each sequence's prompt ends (Batch.prompt_ends): the prompt's rows, chunked
    or not, come below it (the C++ forward computes them as a GEMM); decoded and verified rows at or above it."""
    model, tok = tiny
    seen: list[tuple[list[int], list[int], list[int]]] = []  # per batch: positions, query starts, prompt ends

    def recording(batch: Any, kv: Any) -> torch.Tensor:
        assert batch.prompt_ends is not None
        seen.append((batch.positions.tolist(), batch.query_start.tolist(), batch.prompt_ends.tolist()))
        return model(batch, kv)  # type: ignore[no-any-return]

    recording.args, recording.device, recording.dtype = model.args, model.device, model.dtype  # type: ignore[attr-defined]
    recording.new_pool, recording.ensure_rope = model.new_pool, model.ensure_rope  # type: ignore[attr-defined]
    recording.truncated, recording.sampler_factory = model.truncated, None  # type: ignore[attr-defined]
    recording.row_scan, recording.suffix_index = model.row_scan, model.suffix_index  # type: ignore[attr-defined]
    engine = Engine(recording, tok, max_seq_len=256, pool_tokens=4096, prefill_chunk=16)  # type: ignore[arg-type]
    prompt = prompts(1, model.args.vocab_size, seed=9)[0][:40]
    out = run_alone(Generator(model, tok, engine=engine),
                    GenerationRequest(prompt_ids=prompt, settings=GREEDY, max_new_tokens=5, stop_token_ids=[]))
    assert len(out) == 5
    prompt_rows = [p for positions, _, ends in seen for p in positions if p < ends[0]]
    others = [p for positions, _, ends in seen for p in positions if p >= ends[0]]
    assert {ends[0] for _, _, ends in seen} == {len(prompt)}
    assert prompt_rows == list(range(len(prompt)))  # in chunks of 16, 16, 8
    assert others == list(range(len(prompt), len(prompt) + 4))  # the fed-back tokens (the 5th is never fed)


def serve_all(engine: Engine, model: Any, tok: Tokenizer, reqs: list[tuple[object, GenerationRequest]],
              gens: dict[object, Generator]) -> dict[object, list[ev.Event]]:
    """Submit every request at once to a Worker over `engine`; return each connection's events once all are done."""
    loop = asyncio.new_event_loop()
    events: dict[object, list[ev.Event]] = {key: [] for key, _ in reqs}
    finished = threading.Event()

    def deliver(key: object) -> Any:
        def put(event: ev.Event) -> None:
            events[key].append(event)
            if all(any(isinstance(e, ev.Finished | ev.Failed) for e in es) for es in events.values()):
                finished.set()
                loop.stop()
        return put

    worker = Worker(engine, tok.id_to_text, loop, max_sessions=8, max_queue=8)
    worker.start()
    for key, req in reqs:
        worker.submit(Job(key=key, request_id=str(key), request=req, deliver=deliver(key), client=key))
    loop.call_later(120, loop.stop)
    loop.run_forever()
    worker.stop()
    loop.close()
    assert finished.is_set(), f"not every request finished: {events}"
    return events


def text_of(es: list[ev.Event]) -> str:
    return "".join(e.text for e in es if isinstance(e, ev.Tokens))


def test_pool_too_small_queues_requests_and_serves_them_all(tiny: tuple[Any, Tokenizer]) -> None:
    model, tok = tiny
    ps = same_length(5, 40, model.args.vocab_size, seed=4)
    reqs = [GenerationRequest(prompt_ids=p, settings=GREEDY, max_new_tokens=20, stop_token_ids=[]) for p in ps]
    engine = Engine(model, tok, max_seq_len=256, pool_tokens=160)  # 10 pages; each request comes to hold 4
    keys = [object() for _ in reqs]
    gens: dict[object, Generator] = {}
    events = serve_all(engine, model, tok, list(zip(keys, reqs, strict=True)), gens)
    queued = [k for k in keys if any(isinstance(e, ev.Queued) for e in events[k])]
    assert len(queued) >= 2  # at most two fit at once: the rest waited with their position shown
    for key, req in zip(keys, reqs, strict=True):
        es = events[key]
        assert not any(isinstance(e, ev.Failed) for e in es), es
        done = [e for e in es if isinstance(e, ev.Finished)]
        assert len(done) == 1 and done[0].reason == "max_new_tokens"
        alone = Generator(model, tok, max_seq_len=256)
        alone.begin_stream(req)
        text = ""
        while not (res := alone.stream()).eos:
            text += res.text
        assert text_of(es) == text + res.text
    assert engine.pool.used_pages <= engine.pool.usable_pages


def test_session_evicted_under_pressure_re_prefills_correctly(tiny: tuple[Any, Tokenizer]) -> None:
    model, tok = tiny
    ps = same_length(3, 60, model.args.vocab_size, seed=5)
    engine = Engine(model, tok, max_seq_len=256, pool_tokens=160)
    a = Generator(model, tok, engine=engine)
    first = run_alone(a, GenerationRequest(prompt_ids=ps[0], settings=GREEDY, max_new_tokens=10, stop_token_ids=[]))
    assert len(a.cache_ids) == len(ps[0]) + 9  # a's turn stays in the pool for its next turn
    for p in ps[1:]:  # other sessions need the pages: a's idle pages are evicted (least recently used)
        run_alone(Generator(model, tok, engine=engine),
                  GenerationRequest(prompt_ids=p, settings=GREEDY, max_new_tokens=60, stop_token_ids=[]))
    assert a.cache_ids == []
    turn2 = ps[0] + first + [5, 6, 7]
    req = GenerationRequest(prompt_ids=turn2, settings=GREEDY, max_new_tokens=12, stop_token_ids=[])
    info = a.begin_stream(req)
    assert info.reused_tokens < len(ps[0])  # evicted: most of it is prefilled again
    again: list[int] = []
    while not (res := a.stream()).eos:
        again += res.token_ids
    again += res.token_ids
    assert again == run_alone(Generator(model, tok, max_seq_len=256), req)


@pytest.mark.real_model
@pytest.mark.parametrize("precision", ["exact", "int8"])
def test_real_model_greedy_alone_equals_batched_for_every_fidelity_prompt(real_model_dir: Path,
                                                                          precision: str) -> None:
    model, tok = load_model(real_model_dir, precision=precision), Tokenizer.from_dir(real_model_dir)
    ids = [tok.encode(tok.apply_chat_template(m, add_generation_prompt=True)) for m in FIDELITY_PROMPTS]
    fillers = [p[:120] for p in prompts(11, model.args.vocab_size, seed=6)]  # 16 in all, mixed lengths and modes
    modes = ["none", "ngram", "self", "auto"]
    reqs = [GenerationRequest(prompt_ids=p, settings=GREEDY, max_new_tokens=16, stop_token_ids=[],
                              speculative=modes[i % 4]) for i, p in enumerate(ids + fillers)]  # fmt: skip
    engine = Engine(model, tok, max_seq_len=1024, pool_tokens=16 * 512, self_draft_layers=8)
    together = run_together([Generator(model, tok, engine=engine) for _ in reqs], reqs)
    for i, p in enumerate(ids):
        alone = run_alone(Generator(model, tok, max_seq_len=1024),
                          GenerationRequest(prompt_ids=p, settings=GREEDY, max_new_tokens=16, stop_token_ids=[]))
        assert together[i] == alone, f"fidelity prompt {i}: batched {together[i]} vs alone {alone}"
