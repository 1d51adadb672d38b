"""Fidelity on the real default model: our float32 logits and greedy text against Hugging Face transformers."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from webchat.kernels.backend import load_model
from webchat.model.transformer import Transformer
from webchat.text.tokenizer import Tokenizer

pytestmark = pytest.mark.real_model

PROMPTS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are a terse assistant."}, {"role": "user", "content": "List three primes."}],
    [{"role": "user", "content": "Explain 🚀 and 🎉 emoji in one sentence each. 😀"}],
    [{"role": "user", "content": "Translate to English: Привет, как дела? こんにちは、元気ですか？"}],
    [{"role": "user", "content": "Write a Python function that reverses a string, café-style naïve code."}],
]


@pytest.fixture(scope="module")
def ours(real_model_dir: Path) -> Transformer:
    return load_model(real_model_dir, dtype=torch.float32, precision="exact")


@pytest.fixture(scope="module")
def reference(real_model_dir: Path) -> Any:
    transformers = pytest.importorskip("transformers")
    return transformers.AutoModelForCausalLM.from_pretrained(real_model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def tok(real_model_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(real_model_dir)


def prompt_ids(tok: Tokenizer, messages: list[dict[str, str]]) -> torch.Tensor:
    return torch.tensor(tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True)))


@pytest.mark.parametrize("idx", range(len(PROMPTS)))
def test_logits_match_transformers(ours: Transformer, reference: Any, tok: Tokenizer, idx: int) -> None:
    ids = prompt_ids(tok, PROMPTS[idx])
    got = ours.new_cache(len(ids)).feed(ours, ids.tolist(), all_logits=True)
    with torch.no_grad():
        want = reference(ids.unsqueeze(0)).logits[0].float()
    delta = (got - want).abs().max().item()
    assert delta <= 1e-3, f"max |Δlogit| {delta:.2e} over {len(ids)} positions"
    assert torch.equal(got.argmax(-1), want.argmax(-1))


@pytest.mark.parametrize("idx", range(len(PROMPTS)))
def test_greedy_64_tokens_match_transformers(ours: Transformer, reference: Any, tok: Tokenizer, idx: int) -> None:
    # 64 tokens even past an end token: like min_new_tokens on the reference side, mask its end-of-sequence ids.
    ids = prompt_ids(tok, PROMPTS[idx])
    eos = reference.generation_config.eos_token_id
    eos = torch.tensor(eos if isinstance(eos, list) else [eos])
    cache, x, got = ours.new_cache(len(ids) + 64), ids.tolist(), []
    for _ in range(64):
        logits = cache.feed(ours, x)[-1]
        logits = logits.index_fill(0, eos, float("-inf"))
        nxt = int(logits.argmax())
        got.append(nxt)
        x = [nxt]
    with torch.no_grad():
        out = reference.generate(
            ids.unsqueeze(0), attention_mask=torch.ones(1, len(ids), dtype=torch.long), max_new_tokens=64,
            min_new_tokens=64, do_sample=False, temperature=None, top_p=None, top_k=None, pad_token_id=tok.eos_id,
        )
    want = out[0, len(ids) :].tolist()
    first = next((i for i, (a, b) in enumerate(zip(got, want, strict=True)) if a != b), None)
    assert got == want, f"first difference at token {first}"
