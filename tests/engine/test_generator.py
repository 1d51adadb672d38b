"""The streaming generator on the tiny model (every invariant) and on the real default model (a few, short)."""

from __future__ import annotations

import argparse
import io
import os
import signal
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from bench.tiny import make_tiny_model
from webchat.cli.chat import loop as chat_loop
from webchat.engine.generator import Generator
from webchat.engine.sequence import GenerationRequest, StreamResult
from webchat.engine.settings import SamplingSettings
from webchat.engine.spec.verify_cost import VerifyCost
from webchat.kernels.backend import load_model
from webchat.model.batch import Batch
from webchat.model.kv_cache import KVPool
from webchat.text.detok import decode_all
from webchat.text.tokenizer import Tokenizer

GREEDY = SamplingSettings(temperature=0.0)
PROMPT = [{"role": "user", "content": "Hello world! How are you today? The quick brown fox jumps over the lazy dog."}]


@pytest.fixture(scope="module")
def tiny(tiny_model_dir: Path) -> tuple[Any, Tokenizer]:
    return load_model(tiny_model_dir), Tokenizer.from_dir(tiny_model_dir)


@pytest.fixture(scope="module")
def tiny_draft(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """Another random tiny model with the same tokenizer: a draft model that is often wrong."""
    return load_model(make_tiny_model(tmp_path_factory.mktemp("tiny-draft"), seed=1))


@pytest.fixture(params=["none", "auto"])
def mode(request: pytest.FixtureRequest) -> str:
    """The speculative mode a test runs in: "auto" grants every draft it is offered (every step verifies)."""
    return str(request.param)


def gen_in(mode: str, model: Any, tok: Tokenizer, **kw: Any) -> Generator:
    gen = Generator(model, tok, **kw)
    if mode == "auto":
        gen.engine.auto.cost = VerifyCost.flat()
    return gen


def chat_ids(tok: Tokenizer, messages: list[dict[str, str]] = PROMPT) -> list[int]:
    return tok.encode(tok.apply_chat_template(messages))


def run(gen: Generator, **kw: Any) -> list[StreamResult]:
    gen.begin_stream(GenerationRequest(**kw))
    out = [gen.stream()]
    while not out[-1].eos:
        out.append(gen.stream())
    return out


def text_of(results: list[StreamResult]) -> str:
    return "".join(r.text for r in results)


def ids_of(results: list[StreamResult]) -> list[int]:
    return [t for r in results for t in r.token_ids]


# ---------------------------------------------------------------- text, pieces, stops
def test_text_pieces_and_ids_agree(tiny: tuple[Any, Tokenizer], mode: str) -> None:
    model, tok = tiny
    res = run(gen_in(mode, model, tok), prompt_ids=chat_ids(tok), settings=SamplingSettings(seed=3),
              max_new_tokens=80, stop_token_ids=[], return_probs=True, speculative=mode)
    assert res[-1].eos_reason == "max_new_tokens"
    for r in res:
        assert "".join(t.piece for t in r.tokens) == r.text
        assert [t.id for t in r.tokens] == r.token_ids
    ids = ids_of(res)
    assert len(ids) == 80
    assert text_of(res) == decode_all(tok.token_bytes, ids)
    assert res[-1].stats is not None and res[-1].stats.new_tokens == 80
    plain = run(Generator(model, tok), prompt_ids=chat_ids(tok), settings=SamplingSettings(seed=3),
                max_new_tokens=80, stop_token_ids=[], return_probs=True)
    assert ids == ids_of(plain)


def test_stop_string_cut_from_the_text(tiny: tuple[Any, Tokenizer], mode: str) -> None:
    model, tok = tiny
    full = text_of(run(Generator(model, tok), prompt_ids=chat_ids(tok), settings=GREEDY, max_new_tokens=60,
                       stop_token_ids=[]))
    assert len(full) > 20
    stop = full[12:16]
    expected = full[: full.find(stop)]
    res = run(gen_in(mode, model, tok), prompt_ids=chat_ids(tok), settings=GREEDY, max_new_tokens=60,
              stop_token_ids=[], stop_strings=[stop], speculative=mode)
    assert text_of(res) == expected
    assert res[-1].eos_reason == "stop_string" and res[-1].eos_trigger == stop
    shown = ""
    for r in res:  # no prefix of the stop string is ever shown past the cut
        shown += r.text
        assert expected.startswith(shown)


class ScriptedModel:
    """Logits that pick script[i] for the i-th token after the prompt (then token 0): exact control of the output."""

    def __init__(self, vocab: int, script: list[int], prompt_len: int) -> None:
        self.args = SimpleNamespace(vocab_size=vocab, n_layers=1, n_kv_heads=1, head_dim=1, max_seq_len=256)
        self.device, self.dtype = torch.device("cpu"), torch.float32
        self.script, self.prompt_len = script, prompt_len
        self.fed: list[int] = []
        self.sampler_factory = self.row_scan = self.suffix_index = None

    def new_pool(self, n_tokens: int, page_size: int | None = None) -> KVPool:
        ps = page_size or 16
        return KVPool(self.args, -(-n_tokens // ps) + 1, "cpu", torch.float32, ps)  # type: ignore[arg-type]

    def ensure_rope(self, n: int) -> None:
        pass

    def truncated(self, n: int) -> Any:
        return self

    def __call__(self, batch: Batch, kv: KVPool) -> torch.Tensor:
        self.fed += batch.tokens.tolist()
        positions = batch.positions[batch.logit_rows].tolist()
        rows = torch.zeros(len(positions), self.args.vocab_size)
        for r, pos in enumerate(positions):
            i = pos + 1 - self.prompt_len
            rows[r, self.script[i] if 0 <= i < len(self.script) else 0] = 10.0
        return rows


def byte_ids(tok: Tokenizer, text: str) -> list[int]:
    table = {tok.token_bytes(i): i for i in range(tok.vocab_size)}
    return [table[bytes([b])] for b in text.encode()]


def test_emoji_split_over_byte_tokens_never_shows_replacement_char(tiny: tuple[Any, Tokenizer]) -> None:
    _, tok = tiny
    text = "Café 🙂 naïve 你好"
    script = byte_ids(tok, text)
    prompt = chat_ids(tok)
    gen = Generator(ScriptedModel(tok.vocab_size, script, len(prompt)), tok)
    res = run(gen, prompt_ids=prompt, settings=GREEDY, max_new_tokens=len(script), stop_token_ids=[],
              return_probs=True)
    assert text_of(res) == text
    pieces = [t.piece for r in res for t in r.tokens]
    assert "\ufffd" not in "".join(pieces)
    smiley = text.encode().index("🙂".encode())
    assert pieces[smiley : smiley + 4] == ["", "", "", "🙂"]


def test_stop_string_inside_one_token_and_across_byte_tokens(tiny: tuple[Any, Tokenizer]) -> None:
    _, tok = tiny
    prompt = chat_ids(tok)
    script = tok.encode("Paris is the capital") + byte_ids(tok, "🙂 more")
    gen = Generator(ScriptedModel(tok.vocab_size, script, len(prompt)), tok)
    res = run(gen, prompt_ids=prompt, settings=GREEDY, max_new_tokens=40, stop_token_ids=[],
              stop_strings=["apit", "🙂 m"])
    assert text_of(res) == "Paris is the c"
    assert res[-1].eos_trigger == "apit"
    res = run(gen, prompt_ids=prompt, settings=GREEDY, max_new_tokens=40, stop_token_ids=[], stop_strings=["🙂 m"])
    assert text_of(res) == "Paris is the capital" and res[-1].eos_reason == "stop_string"


def test_stop_token_ends_without_its_text(tiny: tuple[Any, Tokenizer], mode: str) -> None:
    model, tok = tiny
    free = ids_of(run(Generator(model, tok), prompt_ids=chat_ids(tok), settings=GREEDY, max_new_tokens=30,
                      stop_token_ids=[]))
    stop_id = free[6]
    first = free.index(stop_id)
    res = run(gen_in(mode, model, tok), prompt_ids=chat_ids(tok), settings=GREEDY, max_new_tokens=30,
              stop_token_ids=[stop_id], speculative=mode)
    assert ids_of(res) == free[:first]
    assert res[-1].eos_reason == "stop_token" and res[-1].eos_trigger == stop_id
    assert res[-1].stats is not None and res[-1].stats.new_tokens == first + 1
    eos_first = run(Generator(model, tok), prompt_ids=chat_ids(tok),
                    settings=SamplingSettings(temperature=0, token_bias={tok.stop_token_ids[0]: 100.0}))
    assert text_of(eos_first) == "" and eos_first[-1].eos_trigger == tok.stop_token_ids[0]


def test_context_full(tiny: tuple[Any, Tokenizer], mode: str) -> None:
    model, tok = tiny
    prompt = chat_ids(tok)
    gen = gen_in(mode, model, tok, max_seq_len=len(prompt) + 7)
    res = run(gen, prompt_ids=prompt, settings=GREEDY, max_new_tokens=100, stop_token_ids=[], speculative=mode)
    assert res[-1].eos_reason == "context_full"
    assert len(ids_of(res)) == 7
    with pytest.raises(ValueError, match=f"prompt is {len(prompt)} tokens; the cache holds at most 10"):
        Generator(model, tok, max_seq_len=10).begin_stream(GenerationRequest(prompt_ids=prompt))


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"prompt_ids": []}, "at least one token"),
        ({"prompt_ids": [1, 99999]}, r"integers in \[0, 511\], got 99999"),
        ({"prompt_ids": [1], "max_new_tokens": 0}, "max_new_tokens must be at least 1, got 0"),
        ({"prompt_ids": [1], "top_alts": 21}, r"top_alts must be in \[0, 20\], got 21"),
        ({"prompt_ids": [1], "speculative": "magic"}, "speculative must be one of"),
        ({"prompt_ids": [1], "speculative": "draft"}, "needs a draft model"),
    ],
)
def test_bad_requests_rejected(tiny: tuple[Any, Tokenizer], kw: dict[str, Any], match: str) -> None:
    model, tok = tiny
    with pytest.raises(ValueError, match=match):
        Generator(model, tok).begin_stream(GenerationRequest(**kw))


# ---------------------------------------------------------------- probabilities
def test_probabilities_are_the_models(tiny: tuple[Any, Tokenizer], mode: str) -> None:
    model, tok = tiny
    prompt = chat_ids(tok)
    res = run(gen_in(mode, model, tok), prompt_ids=prompt, settings=SamplingSettings(seed=5, top_k=10),
              max_new_tokens=12, stop_token_ids=[], return_probs=True, top_alts=4, return_logits=True,
              speculative=mode)
    tokens = [t for r in res for t in r.tokens]
    seq = prompt + [t.id for t in tokens]
    logits = model.new_cache().feed(model, seq[:-1], all_logits=True)[len(prompt) - 1 :]  # (12, vocab) reference
    probs = torch.softmax(logits, -1)
    for i, t in enumerate(tokens):
        assert t.prob == pytest.approx(float(probs[i, t.id]), rel=1e-4, abs=1e-6)
        assert t.rank == int((probs[i] > probs[i, t.id]).sum()) + 1
        assert [a for a, _, _ in t.top] == torch.topk(probs[i], 4).indices.tolist()
        assert [a_text for _, a_text, _ in t.top] == [tok.id_to_text(a) for a, _, _ in t.top]
        assert t.sampled_prob is not None and t.sampled_prob >= t.prob - 1e-6  # top-k renormalises upward
        assert t.logits is not None and torch.allclose(t.logits, logits[i], atol=1e-4)


def test_probabilities_off_by_default(tiny: tuple[Any, Tokenizer]) -> None:
    model, tok = tiny
    res = run(Generator(model, tok), prompt_ids=chat_ids(tok), settings=GREEDY, max_new_tokens=5, stop_token_ids=[])
    tokens = [t for r in res for t in r.tokens]
    assert tokens and all(t.prob is None and t.rank is None and t.top == [] and t.logits is None for t in tokens)


# ---------------------------------------------------------------- seeds, cache reuse, cancel
def test_same_seed_same_text(tiny: tuple[Any, Tokenizer], mode: str) -> None:
    model, tok = tiny
    settings = SamplingSettings(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=11)
    a = ids_of(run(Generator(model, tok), prompt_ids=chat_ids(tok), settings=settings, max_new_tokens=40,
                   stop_token_ids=[]))
    b = ids_of(run(gen_in(mode, model, tok), prompt_ids=chat_ids(tok), settings=settings, max_new_tokens=40,
                   stop_token_ids=[], speculative=mode))
    c = ids_of(run(Generator(model, tok), prompt_ids=chat_ids(tok),
                   settings=SamplingSettings(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=12),
                   max_new_tokens=40, stop_token_ids=[]))
    assert a == b and a != c


class CountingModel:
    """Wraps a model and counts the tokens it is asked to process."""

    def __init__(self, model: Any) -> None:
        self.model, self.args, self.device, self.dtype, self.fed = model, model.args, model.device, model.dtype, 0
        self.sampler_factory = self.row_scan = self.suffix_index = None

    def new_pool(self, n_tokens: int, page_size: int | None = None) -> KVPool:
        return self.model.new_pool(n_tokens, page_size)  # type: ignore[no-any-return]

    def ensure_rope(self, n: int) -> None:
        self.model.ensure_rope(n)

    def truncated(self, n: int) -> Any:
        return self.model.truncated(n)

    def __call__(self, batch: Batch, kv: KVPool) -> torch.Tensor:
        self.fed += batch.tokens.shape[0]
        return self.model(batch, kv)  # type: ignore[no-any-return]


def test_cache_reuse_matches_a_cold_start_and_prefills_only_new_tokens(tiny: tuple[Any, Tokenizer]) -> None:
    model, tok = tiny
    counting = CountingModel(model)
    warm = Generator(counting, tok)
    turn1 = run(warm, prompt_ids=chat_ids(tok), settings=GREEDY, max_new_tokens=20, stop_token_ids=[])
    messages = [*PROMPT, {"role": "assistant", "content": text_of(turn1)}, {"role": "user", "content": "And then?"}]
    prompt2 = chat_ids(tok, messages)
    shared = next(i for i, (a, b) in enumerate(zip(warm.cache_ids, prompt2, strict=False)) if a != b)
    assert shared > len(chat_ids(tok))  # the whole first turn's prompt at least
    counting.fed = 0
    turn2 = run(warm, prompt_ids=prompt2, settings=GREEDY, max_new_tokens=20, stop_token_ids=[])
    assert turn2[-1].stats is not None and turn2[-1].stats.reused_tokens == shared
    assert counting.fed == len(prompt2) - shared + 19  # the new prompt tokens, then one per token after the first
    cold = run(Generator(model, tok), prompt_ids=prompt2, settings=GREEDY, max_new_tokens=20, stop_token_ids=[])
    assert ids_of(turn2) == ids_of(cold)
    # the very same prompt twice (a regenerate): all of it is reused, and the logits kept from its first run give the
    # first token with no forward at all
    again = Generator(counting, tok)
    first = run(again, prompt_ids=prompt2, settings=GREEDY, max_new_tokens=4, stop_token_ids=[], return_probs=True)
    counting.fed = 0
    second = run(again, prompt_ids=prompt2, settings=GREEDY, max_new_tokens=4, stop_token_ids=[], return_probs=True)
    assert second[-1].stats is not None and second[-1].stats.reused_tokens == len(prompt2)
    assert counting.fed == 3  # the three tokens after the first
    assert ids_of(second) == ids_of(first)
    assert [t.prob for r in second for t in r.tokens] == [t.prob for r in first for t in r.tokens]
    again.engine.reset()  # a cold start forgets the kept logits with the pages
    counting.fed = 0
    run(again, prompt_ids=prompt2, settings=GREEDY, max_new_tokens=1)
    assert counting.fed == len(prompt2)


def test_cancel_interrupts_prefill_between_chunks(tiny: tuple[Any, Tokenizer]) -> None:
    model, tok = tiny
    gen = Generator(model, tok, prefill_chunk=16)
    prompt = chat_ids(tok) * 6
    gen.begin_stream(GenerationRequest(prompt_ids=prompt, settings=GREEDY))
    assert gen.stream().eos is False
    gen.cancel()
    res = gen.stream()
    assert res.eos and res.eos_reason == "cancelled" and res.text == ""
    assert len(gen.cache_ids) == 16
    info = gen.begin_stream(GenerationRequest(prompt_ids=prompt, settings=GREEDY, max_new_tokens=3))
    assert info.reused_tokens == 16  # the interrupted prefill is kept for the next try
    assert run_rest(gen)[-1].eos_reason == "max_new_tokens"


def run_rest(gen: Generator) -> list[StreamResult]:
    out = [gen.stream()]
    while not out[-1].eos:
        out.append(gen.stream())
    return out


def test_cancel_from_another_thread(tiny: tuple[Any, Tokenizer]) -> None:
    model, tok = tiny
    gen = Generator(model, tok)
    gen.begin_stream(GenerationRequest(prompt_ids=chat_ids(tok), settings=GREEDY, max_new_tokens=100_000,
                                       stop_token_ids=[]))
    results: list[StreamResult] = []
    started = threading.Event()

    def loop() -> None:
        while not (results and results[-1].eos):
            results.append(gen.stream())
            if len(results) == 5:
                started.set()

    worker = threading.Thread(target=loop)
    worker.start()
    assert started.wait(30)
    gen.cancel()
    worker.join(30)
    assert results[-1].eos_reason == "cancelled"
    assert 5 <= len(ids_of(results)) < 1000


# ---------------------------------------------------------------- the terminal chat
class InterruptingOut(io.StringIO):
    """Sends SIGINT to this process at the first piece of reply text, as Ctrl-C in a terminal would."""

    def __init__(self) -> None:
        super().__init__()
        self.sent = False

    def write(self, s: str) -> int:
        n = super().write(s)
        if s and not s.startswith(("\n", "[")) and not self.sent and s != "\n> ":
            self.sent = True
            os.kill(os.getpid(), signal.SIGINT)
        return n


def test_chat_ctrl_c_stops_the_reply_not_the_program(tiny: tuple[Any, Tokenizer]) -> None:
    model, tok = tiny
    gen = Generator(model, tok)
    args = argparse.Namespace(system=None, max_new_tokens=60, speculative="none", stats=True)
    # Python's own handler, or SIG_IGN where the process started with SIGINT ignored (a shell's background job)
    before = signal.getsignal(signal.SIGINT)
    out = InterruptingOut()
    inp = io.StringIO("Hello there\nAgain\n/quit\n")
    settings = SamplingSettings(temperature=0, token_bias={i: -100.0 for i in tok.stop_token_ids})
    assert chat_loop(gen, tok, settings, args, inp, out) == 0
    text = out.getvalue()
    assert text.count("[cancelled]") == 1  # the first reply stopped at Ctrl-C ...
    assert text.count("[max_new_tokens]") == 1  # ... and the program went on to the second one
    assert signal.getsignal(signal.SIGINT) is before  # the reply's handler taken back out


# ---------------------------------------------------------------- the real default model
@pytest.mark.real_model
def test_real_model_text_pieces_stops_accents_and_reuse(real_model_dir: Path) -> None:
    model, tok = load_model(real_model_dir), Tokenizer.from_dir(real_model_dir)
    messages = [{"role": "user", "content": "Translate to French, with all accents: 'The naive student drank a coffee "
                 "at the cafe in Zurich.' Then add a smiling emoji."}]
    prompt = chat_ids(tok, messages)
    gen = Generator(model, tok, max_seq_len=512)
    res = run(gen, prompt_ids=prompt, settings=GREEDY, max_new_tokens=40, return_probs=True, top_alts=3)
    text, ids = text_of(res), ids_of(res)
    assert any(ord(c) > 127 for c in text), text  # accents or emoji, split over byte tokens by this tokenizer
    assert "\ufffd" not in text
    assert "".join(t.piece for r in res for t in r.tokens) == text
    assert text == decode_all(tok.token_bytes, ids)
    assert all(t.prob is not None and 0 < t.prob <= 1 and t.rank == 1 for r in res for t in r.tokens)  # greedy
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    cut = run(gen, prompt_ids=prompt, settings=GREEDY, max_new_tokens=40, stop_strings=[stop])
    assert text_of(cut) == text[: text.find(stop)] and cut[-1].eos_reason == "stop_string"
    assert cut[-1].stats is not None and cut[-1].stats.reused_tokens == len(prompt)  # and its kept first logits
    turn2 = chat_ids(tok, [*messages, {"role": "assistant", "content": text_of(cut)},
                           {"role": "user", "content": "Thanks!"}])
    warm = run(gen, prompt_ids=turn2, settings=GREEDY, max_new_tokens=16)
    assert warm[-1].stats is not None and warm[-1].stats.reused_tokens >= len(prompt)
    cold = run(Generator(model, tok, max_seq_len=512), prompt_ids=turn2, settings=GREEDY, max_new_tokens=16)
    assert ids_of(warm) == ids_of(cold)
