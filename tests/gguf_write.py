"""Test helper: a Hugging Face folder (config, model.safetensors, tokenizer.json) written as a GGUF by `gguf`'s own
GGUFWriter, the way llama.cpp's convert_hf_to_gguf.py lays it out (llama.cpp names, llama's q/k rows permuted), each
tensor in the ggml type `qtype(name, array)` picks (Q4_K and Q6_K by tests/kquant_encode.py)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
from safetensors.numpy import load_file

from tests.kquant_encode import encode_q4_k, encode_q6_k
from webchat.convert import GLOBAL_MAP, LAYER_MAP, ROPE_FREQS, Hyper, llama3_factors, permute_rows

QType = Callable[[str, np.ndarray], gguf.GGMLQuantizationType]
F32 = gguf.GGMLQuantizationType.F32


def all_f32(name: str, w: np.ndarray) -> gguf.GGMLQuantizationType:
    return F32


def gguf_name(hf: str) -> str:
    for ours, theirs in GLOBAL_MAP.items():
        if theirs == hf:
            return ours
    _, _, i, rest = hf.split(".", 3)
    return f"blk.{i}.{next(k for k, v in LAYER_MAP.items() if v == rest)}"


def write_gguf(folder: Path, out: Path, arch: str, qtype: QType = all_f32, pre: str = "smollm") -> None:
    cfg = json.loads((folder / "config.json").read_text())
    tok = json.loads((folder / "tokenizer.json").read_text())
    n_heads, n_kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    w = gguf.GGUFWriter(str(out), arch=arch)
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(n_heads)
    w.add_head_count_kv(n_kv)
    w.add_key_length(cfg["head_dim"])
    w.add_value_length(cfg["head_dim"])
    w.add_rope_freq_base(float((cfg.get("rope_parameters") or {}).get("rope_theta", cfg.get("rope_theta", 1e4))))
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    vocab: dict[str, int] = tok["model"]["vocab"]
    tokens = sorted(vocab, key=vocab.__getitem__)
    special = {t["content"] for t in tok.get("added_tokens", []) if t.get("special")}
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types([int(gguf.TokenType.CONTROL if t in special else gguf.TokenType.NORMAL) for t in tokens])
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    template = json.loads((folder / "tokenizer_config.json").read_text()).get("chat_template")
    if template:
        w.add_chat_template(template)
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
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
        kind = qtype(name, t)
        encoders = {gguf.GGMLQuantizationType.Q4_K: encode_q4_k, gguf.GGMLQuantizationType.Q6_K: encode_q6_k}
        data = t if kind == F32 else encoders[kind](t) if kind in encoders else gguf.quants.quantize(t, kind)
        w.add_tensor(gguf_name(name), data, raw_dtype=None if kind == F32 else kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
