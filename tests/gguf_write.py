"""Test helper: a Hugging Face folder (config, model.safetensors, tokenizer.json) written as a GGUF by `gguf`'s own
GGUFWriter, the way llama.cpp's convert_hf_to_gguf.py lays it out (llama.cpp names, llama's q/k rows permuted, Gemma's
norms stored as 1 + w, its Gemma2/Gemma3/Phi3 keys), each tensor in the ggml type `qtype(name, array)` picks (Q4_K and
Q6_K by tests/kquant_encode.py); the vocabulary is the folder's byte-level BPE, or a SentencePiece model
(`train_spm`, written as convert_hf_to_gguf.py's _create_vocab_sentencepiece writes one)."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np
from kquant_encode import encode_q4_k, encode_q6_k
from safetensors.numpy import load_file

from webchat.gguf.convert import GEMMAS, GLOBAL_MAP, ROPE_FREQS, Hyper, layer_map, llama3_factors, permute_rows

QType = Callable[[str, np.ndarray], gguf.GGMLQuantizationType]
F32 = gguf.GGMLQuantizationType.F32


def all_f32(name: str, w: np.ndarray) -> gguf.GGMLQuantizationType:
    return F32


@dataclass
class SpmVocab:
    """A SentencePiece vocabulary as a GGUF stores it, and the SentencePieceProcessor it came from (the reference)."""

    tokens: list[str]
    scores: list[float]
    types: list[int]
    add_space_prefix: bool
    processor: Any


def train_spm(folder: Path, corpus: str, vocab_size: int, add_space_prefix: bool,
              control: tuple[str, ...] = (), user_defined: tuple[str, ...] = ()) -> SpmVocab:
    """A BPE SentencePiece model with byte fallback trained on corpus (no normalization, spaces kept as they are)."""
    import sentencepiece as spm

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "corpus.txt").write_text(corpus, encoding="utf-8")
    spm.SentencePieceTrainer.train(
        input=str(folder / "corpus.txt"), model_prefix=str(folder / "spm"), vocab_size=vocab_size, model_type="bpe",
        byte_fallback=True, character_coverage=1.0, normalization_rule_name="identity",
        remove_extra_whitespaces=False, add_dummy_prefix=add_space_prefix, split_digits=True, num_threads=1,
        control_symbols=list(control), user_defined_symbols=list(user_defined), minloglevel=2)
    sp = spm.SentencePieceProcessor(model_file=str(folder / "spm.model"))
    tokens, scores, types = [], [], []
    for i in range(sp.vocab_size()):  # convert_hf_to_gguf.py's _create_vocab_sentencepiece
        kind = gguf.TokenType.NORMAL
        if sp.IsUnknown(i):
            kind = gguf.TokenType.UNKNOWN
        elif sp.IsControl(i):
            kind = gguf.TokenType.CONTROL
        elif sp.IsUnused(i):
            kind = gguf.TokenType.UNUSED
        elif sp.IsByte(i):
            kind = gguf.TokenType.BYTE
        elif sp.IdToPiece(i) in user_defined:  # what tokenizer_config's added tokens mark USER_DEFINED
            kind = gguf.TokenType.USER_DEFINED
        tokens.append(sp.IdToPiece(i))
        scores.append(sp.GetScore(i))
        types.append(int(kind))
    return SpmVocab(tokens, scores, types, add_space_prefix, sp)


def gguf_name(hf: str, arch: str = "llama") -> str:
    for ours, theirs in GLOBAL_MAP.items():
        if theirs == hf:
            return ours
    _, _, i, rest = hf.split(".", 3)
    return f"blk.{i}.{next(k for k, v in layer_map(arch).items() if v == rest)}"


def write_gguf(folder: Path, out: Path, arch: str, qtype: QType = all_f32, pre: str = "smollm",
               spm: SpmVocab | None = None, template: str | None = None) -> None:
    cfg = json.loads((folder / "config.json").read_text())
    n_heads, n_kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    w = gguf.GGUFWriter(str(out), arch=arch)
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(n_heads)
    w.add_head_count_kv(n_kv)
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // n_heads
    if arch != "phi3":  # Phi3MiniModel writes no key length: the head is dim / heads
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    rope = rope.get("full_attention", rope)
    w.add_rope_freq_base(float(rope.get("rope_theta", cfg.get("rope_theta", 1e4))))
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    _arch_keys(w, arch, cfg, rope, head_dim)
    if spm is None:
        tok = json.loads((folder / "tokenizer.json").read_text())
        vocab: dict[str, int] = tok["model"]["vocab"]
        tokens = sorted(vocab, key=vocab.__getitem__)
        special = {t["content"] for t in tok.get("added_tokens", []) if t.get("special")}
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre(pre)
        w.add_token_list(tokens)
        w.add_token_types([int(gguf.TokenType.CONTROL if t in special else gguf.TokenType.NORMAL) for t in tokens])
        w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]])
    else:  # _set_vocab_sentencepiece
        w.add_tokenizer_model("llama")
        w.add_tokenizer_pre("default")
        w.add_token_list(spm.tokens)
        w.add_token_scores(spm.scores)
        w.add_token_types(spm.types)
        w.add_unk_token_id(0)
        if not spm.add_space_prefix:
            w.add_add_space_prefix(False)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    if template is None and (folder / "tokenizer_config.json").is_file():
        template = json.loads((folder / "tokenizer_config.json").read_text()).get("chat_template")
    if template:
        w.add_chat_template(template)
    if rope.get("rope_type") == "llama3":  # convert_hf_to_gguf.py writes llama3 scaling as per-frequency divisors
        h = Hyper(n_layers=0, dim=0, ffn_dim=0, n_heads=n_heads, n_kv_heads=n_kv, head_dim=cfg["head_dim"],
                  vocab_size=0, norm_eps=0.0, rope_theta=float(rope["rope_theta"]), context_length=0)
        w.add_tensor(ROPE_FREQS, llama3_factors(h, rope["factor"], rope["original_max_position_embeddings"],
                                                rope["low_freq_factor"], rope["high_freq_factor"]))
    tensors = load_file(str(folder / "model.safetensors"))
    for name, t in tensors.items():
        if name == "lm_head.weight" and cfg.get("tie_word_embeddings"):
            continue
        t = t.astype(np.float32)
        if arch == "llama" and ".q_proj." in name:
            t = permute_rows(t, n_heads)
        elif arch == "llama" and ".k_proj." in name:
            t = permute_rows(t, n_kv)
        elif arch in GEMMAS and name.endswith("norm.weight"):  # GemmaModel.modify_tensors: norms + 1
            t = t + np.float32(1.0)
        kind = qtype(name, t)
        encoders = {gguf.GGMLQuantizationType.Q4_K: encode_q4_k, gguf.GGMLQuantizationType.Q6_K: encode_q6_k}
        data = t if kind == F32 else encoders[kind](t) if kind in encoders else gguf.quants.quantize(t, kind)
        w.add_tensor(gguf_name(name, arch), data, raw_dtype=None if kind == F32 else kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _arch_keys(w: gguf.GGUFWriter, arch: str, cfg: dict[str, Any], rope: dict[str, Any], head_dim: int) -> None:
    """The keys Gemma2Model, Gemma3Model and Phi3MiniModel.set_gguf_parameters add."""
    if arch == "gemma2":
        w.add_attn_logit_softcapping(cfg["attn_logit_softcapping"])
        w.add_final_logit_softcapping(cfg["final_logit_softcapping"])
        w.add_sliding_window(cfg["sliding_window"])
    elif arch == "gemma3":
        if cfg.get("final_logit_softcapping"):
            w.add_final_logit_softcapping(cfg["final_logit_softcapping"])
        w.add_sliding_window(cfg["sliding_window"])
        if rope.get("rope_type") == "linear":  # TextModel.set_gguf_parameters
            w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            w.add_rope_scaling_factor(rope["factor"])
    elif arch == "phi3":
        w.add_rope_scaling_orig_ctx_len(cfg.get("original_max_position_embeddings") or cfg["max_position_embeddings"])
        w.add_rope_dimension_count(head_dim)
        w.add_sliding_window(cfg.get("sliding_window") or 0)
