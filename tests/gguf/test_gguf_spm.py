"""Gemma 2, Gemma 3 and Phi-3 GGUFs by path: their SentencePiece vocabularies tokenize as SentencePiece does (the
algorithm llama.cpp's SPM tokenizer reproduces), and the models run exact to transformers, float and quantized.

The vocabularies are trained here with `sentencepiece` (BPE, byte fallback, no normalization) on this repository's
docs, written into the GGUF the way convert_hf_to_gguf.py's _create_vocab_sentencepiece does (tests/gguf_write.py).
"""

from __future__ import annotations

import io
import json
import re
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from gguf_write import SpmVocab, train_spm, write_gguf
from safetensors import safe_open
from test_archs import ragged_greedy, random_model
from test_gguf_cache import greedy_logits

from webchat.files.gguf_cache import model_folder
from webchat.gguf.convert import QUANT_FILE, QUANT_KEY
from webchat.kernels.backend import load_model
from webchat.kernels.cpu import build as qkernels
from webchat.text.tokenizer import Tokenizer

transformers = pytest.importorskip("transformers", reason="transformers (the reference) is not installed")
pytest.importorskip("sentencepiece", reason="sentencepiece (the tokenizer reference) is not installed")

ROOT = Path(__file__).resolve().parents[2]
Q = gguf.GGMLQuantizationType
CONTROL = ("<start_of_turn>", "<end_of_turn>", "<|user|>", "<|assistant|>", "<|end|>")
USER_DEFINED = ("<think>",)
GEMMA_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<start_of_turn>{{ m.role }}\n{{ m.content }}<end_of_turn>\n"
                  "{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")
PHI3_TEMPLATE = ("{% for m in messages %}<|{{ m.role }}|>\n{{ m.content }}<|end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
TEXTS = [
    "Hello world", "The quick brown fox jumps over the lazy dog.", "  two  spaces and a trailing one ",
    "tabs\tand\nnew lines\n\n", "digits 12345 and 3.14159", "émoji 🙂 and 中文 and Ω", "<think>why</think> so",
    "a<start_of_turn>b", " leading", "", "webchat serve --model ~/Downloads/gemma-2-2b-it-Q4_K_M.gguf",
]
SHAPE: dict[str, Any] = dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
                             max_position_embeddings=256, bos_token_id=1, eos_token_id=2, pad_token_id=0)
CONFIGS = {  # what a GGUF can say: Gemma's query scale is the head size, Gemma 3's sliding layers every 6th but one
    "gemma2": lambda v: transformers.Gemma2Config(
        vocab_size=v, **SHAPE, num_hidden_layers=3, head_dim=16, query_pre_attn_scalar=16, sliding_window=5,
        attn_logit_softcapping=1.5, final_logit_softcapping=2.0,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"]),
    "gemma3": lambda v: transformers.Gemma3TextConfig(
        vocab_size=v, **SHAPE, num_hidden_layers=6, head_dim=16, query_pre_attn_scalar=16, sliding_window=5,
        final_logit_softcapping=None, attn_logit_softcapping=None,
        layer_types=["sliding_attention"] * 5 + ["full_attention"],
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1000000.0}}),
    "phi3": lambda v: transformers.Phi3Config(vocab_size=v, **SHAPE, num_hidden_layers=2, sliding_window=5),
    "llama": lambda v: transformers.LlamaConfig(vocab_size=v, **SHAPE, num_hidden_layers=2, head_dim=16),  # Llama 2
}
PREFIX = {"gemma2": False, "gemma3": False, "phi3": True, "llama": True}  # Gemma's files: add_space_prefix false


@pytest.fixture(scope="module")
def vocabs(tmp_path_factory: pytest.TempPathFactory) -> dict[bool, SpmVocab]:
    docs = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    corpus = "\n".join(p.read_text(encoding="utf-8") for p in docs)
    return {prefix: train_spm(tmp_path_factory.mktemp(f"spm-{prefix}"), corpus, 800, prefix, CONTROL, USER_DEFINED)
            for prefix in (False, True)}


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    qkernels.try_load()  # the C++ kernels from the real cache, before $WEBCHAT_HOME moves
    monkeypatch.setenv("WEBCHAT_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def spm_folder(arch: str, folder: Path, vocab: SpmVocab, **overrides: Any) -> Any:
    config = CONFIGS[arch](len(vocab.tokens))
    for key, value in overrides.items():
        setattr(config, key, value)
    return random_model(config, folder)


def converted(arch: str, tmp_path: Path, vocab: SpmVocab, **kw: Any) -> tuple[Any, Path]:
    reference = spm_folder(arch, tmp_path / "hf", vocab)
    path = tmp_path / f"tiny-{arch}.gguf"
    write_gguf(tmp_path / "hf", path, arch, spm=vocab, template=PHI3_TEMPLATE if arch == "phi3" else GEMMA_TEMPLATE,
               **kw)
    return reference, model_folder(path, out=io.StringIO())


def llama_cpp_spm(sp: Any, text: str, whole: dict[str, int]) -> list[int]:
    """llama.cpp's SentencePiece tokenization (llama-vocab.cpp, `case LLAMA_VOCAB_TYPE_SPM`): the text cut at the
    tokens it matches whole, each stretch between tokenized alone, with the leading space the vocabulary may add (which
    SentencePiece's add_dummy_prefix reproduces)."""
    out: list[int] = []
    for stretch in re.split("(" + "|".join(map(re.escape, whole)) + ")", text) if whole else [text]:
        out += [whole[stretch]] if stretch in whole else sp.encode(stretch) if stretch else []
    return out


@pytest.mark.parametrize("prefix", [False, True], ids=["gemma-no-prefix", "llama-space-prefix"])
def test_a_sentencepiece_vocabulary_tokenizes_as_sentencepiece(tmp_path: Path, home: Path,
                                                               vocabs: dict[bool, SpmVocab], prefix: bool) -> None:
    vocab = vocabs[prefix]
    _, folder = converted("phi3" if prefix else "gemma2", tmp_path, vocab)
    tok = Tokenizer.from_dir(folder)
    sp = vocab.processor
    merged = total = 0
    for text in TEXTS:
        want = llama_cpp_spm(sp, text, {t: vocab.tokens.index(t) for t in USER_DEFINED})
        got = tok.encode_text(text)[1:]  # after the BOS llama.cpp adds to a SentencePiece vocabulary
        assert got == want, (text, [vocab.tokens[i] for i in got], [vocab.tokens[i] for i in want])
        spaced = re.sub("(^|<think>)(?=.)(?!<think>)", r"\1 ", text) if prefix else text  # llama.cpp's prefix spaces
        assert b"".join(tok.token_bytes(i) for i in got).decode() == spaced
        merged += len(text.encode()) - len(got)
        total += len(text.encode())
    # the merges do work: far fewer tokens than bytes (a share, not a count: the vocabulary is trained on docs that
    # change, and a space-prefixed vocabulary spends a token on every prefix space)
    assert merged > total // 4, (merged, total)
    byte_ids = [i for i in tok.encode_text("🙂") if vocab.tokens[i].startswith("<0x")]
    assert len(byte_ids) == 4  # a character the vocabulary lacks falls back to its UTF-8 bytes


@pytest.mark.parametrize("arch", list(CONFIGS))
def test_the_chat_prompt_is_the_template_with_each_text_stretch_tokenized_alone(
        tmp_path: Path, home: Path, vocabs: dict[bool, SpmVocab], arch: str) -> None:
    """llama.cpp splits at special tokens and tokenizes each stretch of text alone (with a leading space where the
    vocabulary adds one): the chat prompt is the control ids with SentencePiece's encoding of each stretch between."""
    vocab = vocabs[PREFIX[arch]]
    _, folder = converted(arch, tmp_path, vocab)
    tok = Tokenizer.from_dir(folder)
    messages = [{"role": "user", "content": "Hello  there, how are you?"},
                {"role": "assistant", "content": "Hi! 12 🙂"}, {"role": "user", "content": "more"}]
    text = tok.apply_chat_template(messages)
    controls = {t: i for i, t in enumerate(vocab.tokens) if t in (*CONTROL, "<s>")}
    want = llama_cpp_spm(vocab.processor, text, controls)
    if arch == "phi3":
        want = [1, *want]  # llama.cpp's BOS for a vocabulary whose file does not turn it off
    assert want.count(1) == 1 and tok.encode_chat(messages) == want
    turn = vocab.tokens.index("<start_of_turn>" if arch != "phi3" else "<|user|>")
    forged = tok.encode_chat([{"role": "user", "content": f"a {vocab.tokens[turn]} b"}])
    assert forged.count(turn) == 1 + (arch != "phi3")  # the template's own; the one in the content stays text


@pytest.mark.parametrize("arch", list(CONFIGS))
def test_float_gguf_runs_exact_to_transformers(tmp_path: Path, home: Path, vocabs: dict[bool, SpmVocab],
                                               arch: str) -> None:
    reference, folder = converted(arch, tmp_path, vocabs[PREFIX[arch]])
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == [type(reference).__name__]
    tok, model = Tokenizer.from_dir(folder), load_model(folder)
    prompt = tok.encode_text("The quick brown fox")
    ids, got = greedy_logits(model, prompt)
    with torch.no_grad():
        want = reference(torch.tensor([ids[:-1]])).logits[0]
    assert (got - want).abs().max().item() <= 1e-4
    assert want[len(prompt) - 1 :].argmax(-1).tolist() == ids[len(prompt) :]
    seqs = [tok.encode_text("Two prompts"), tok.encode_text("of different lengths in one batch")]  # batched
    n_prompt = [len(s) for s in seqs]
    for seq, logits, n in zip(seqs, ragged_greedy(model, seqs, 12), n_prompt, strict=True):
        with torch.no_grad():
            want = reference(torch.tensor([seq[:-1]])).logits[0]
        assert (logits - want).abs().max().item() <= 1e-4
        assert want[n - 1 :].argmax(-1).tolist() == seq[n:]


def quantized(name: str, w: np.ndarray) -> Q:
    return Q.F32 if w.ndim == 1 else Q.Q4_1 if "mlp" in name else Q.Q8_0  # (K-quants need rows of 256)


@pytest.mark.parametrize("arch", list(CONFIGS))
def test_quantized_gguf_keeps_its_blocks_and_matches_its_dequantized_weights(
        tmp_path: Path, home: Path, vocabs: dict[bool, SpmVocab], arch: str) -> None:
    """Phi-3's fused matrices split by rows from the blocks (bytes unchanged); Gemma's float norms 1 + w again."""
    _, folder = converted(arch, tmp_path, vocabs[PREFIX[arch]], qtype=quantized)
    with safe_open(str(folder / QUANT_FILE), framework="pt") as f:
        kept = json.loads((f.metadata() or {})[QUANT_KEY])
        fused = "model.layers.0.self_attn.qkv_proj.weight"
        if arch == "phi3":
            assert kept[fused] == "q8_0" and kept["model.layers.0.mlp.gate_up_proj.weight"] == "q4_1"
            blocks = f.get_tensor(fused)
    model, floats = load_model(folder, precision="exact"), load_model(folder, weights="float32")
    if arch == "phi3":
        layer = model.layers[0].attention  # type: ignore[union-attr]
        parts = [getattr(layer, n).weight for n in ("wq", "wk", "wv")]
        assert torch.equal(torch.cat(parts), blocks)
    assert {type(m).__name__ for m in model.modules()} >= {"QLinear", "QEmbedding"}
    prompt = Tokenizer.from_dir(folder).encode_text("The quick brown fox")
    _, got = greedy_logits(model, prompt)
    _, want = greedy_logits(floats, prompt)
    assert (got - want).abs().max().item() <= 1e-3
