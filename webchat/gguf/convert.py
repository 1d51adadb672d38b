"""Convert a llama, qwen2, qwen3, gemma2, gemma3 or phi3 GGUF file into a Hugging Face-style folder (float32
safetensors + tokenizer), undoing what llama.cpp's convert_hf_to_gguf.py did (llama's q/k rows permuted, Gemma's norms
stored as 1 + w).

Beside model.safetensors (float32, what transformers loads) it writes quantized.safetensors: the same tensors with
Q4_0/Q4_1/Q5_0/Q5_1/Q8_0/Q4_K/Q5_K/Q6_K matrices kept as their ggml blocks (docs/quant.md), which webchat runs on the
CPU by default. Both are written a tensor at a time; where the float32 file would pass FLOAT_FILE_LIMIT (an 8B model's
is 32 GB, beside a 4.9 GB download) it holds the other tensors only and says so in its metadata, and the float path
decodes the blocks at load (webchat.model.loader).
"""

from __future__ import annotations

import json
import re
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np
from tokenizers import Tokenizer as HFTokenizer

from webchat.gguf.header import GGUFError, keep_none, read_header
from webchat.gguf.vocab import Fields, VocabError, build_tokenizer, special_tokens

# GGUF general.architecture → the Hugging Face architecture and model_type the folder's config.json names
HF_ARCHS = {"llama": ("LlamaForCausalLM", "llama"), "qwen2": ("Qwen2ForCausalLM", "qwen2"),
            "qwen3": ("Qwen3ForCausalLM", "qwen3"), "gemma2": ("Gemma2ForCausalLM", "gemma2"),
            "gemma3": ("Gemma3ForCausalLM", "gemma3_text"), "phi3": ("Phi3ForCausalLM", "phi3")}
GEMMAS = ("gemma2", "gemma3")
SUPPORTED_ARCHS = tuple(HF_ARCHS)
Progress = Callable[[int, int], None]  # (tensors done, tensors in all)

# llama.cpp's per-layer tensor names -> Hugging Face's (gpt-fast style: one explicit table)
LAYER_MAP = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",  # qwen3
    "attn_k_norm.weight": "self_attn.k_norm.weight",
}
QK_NORMS = ("self_attn.q_norm.weight", "self_attn.k_norm.weight")
# Gemma's sandwich norms: llama.cpp's ffn_norm is the norm before the MLP, and two norms follow attention and MLP
GEMMA_LAYER_MAP = {**LAYER_MAP, "ffn_norm.weight": "pre_feedforward_layernorm.weight",
                   "post_attention_norm.weight": "post_attention_layernorm.weight",
                   "post_ffw_norm.weight": "post_feedforward_layernorm.weight"}
# Phi-3's fused matrices, kept fused as transformers holds them (the loader splits them by rows)
PHI3_LAYER_MAP = {**{k: v for k, v in LAYER_MAP.items() if k.split(".")[0] not in ("attn_q", "attn_k", "attn_v",
                                                                                   "ffn_gate", "ffn_up")},
                  "attn_qkv.weight": "self_attn.qkv_proj.weight", "ffn_up.weight": "mlp.gate_up_proj.weight"}
ROPE_FACTORS = ("rope_factors_long.weight", "rope_factors_short.weight")  # Phi-3's longrope


def layer_map(arch: str) -> dict[str, str]:
    return GEMMA_LAYER_MAP if arch in GEMMAS else PHI3_LAYER_MAP if arch == "phi3" else LAYER_MAP
GLOBAL_MAP = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_RE = re.compile(r"blk\.(\d+)\.(.+)")

QUANT_FILE = "quantized.safetensors"
QUANT_KEY = "webchat.model.quant"  # safetensors metadata: JSON {tensor name: "q4_0" | "q4_1" | "q8_0"}
QUANT_LAYOUT_KEY = "webchat.model.quant.layout"
QUANT_LAYOUT = "ggml-blocks-v1"  # uint8 (rows, cols / block values * block bytes), each row its blocks in ggml order
# model.safetensors' metadata where its block matrices are left to QUANT_FILE (a GGUF whose float32 would pass
# FLOAT_FILE_LIMIT: an 8B file's is 32 GB): the float path decodes them from there at load (webchat.model.loader)
FLOATS_IN_BLOCKS_KEY = "webchat.floats_in_blocks"
FLOAT_FILE_LIMIT = 4 << 30
KEPT_QUANTIZED = {
    gguf.GGMLQuantizationType.Q4_0: "q4_0",
    gguf.GGMLQuantizationType.Q4_1: "q4_1",
    gguf.GGMLQuantizationType.Q5_0: "q5_0",
    gguf.GGMLQuantizationType.Q5_1: "q5_1",
    gguf.GGMLQuantizationType.Q8_0: "q8_0",
    gguf.GGMLQuantizationType.Q4_K: "q4_k",  # 256-value super-blocks (kernels/cpu/csrc/qkquant.cpp)
    gguf.GGMLQuantizationType.Q5_K: "q5_k",
    gguf.GGMLQuantizationType.Q6_K: "q6_k",
}
# decoded by webchat.model.quant.dequantize_k (the rest by gguf.quants); Q2_K/Q3_K matrices are dequantized to float32
# in both files (webchat has no kernel for them: docs/quant.md)
K_QUANTS = {gguf.GGMLQuantizationType.Q4_K: "q4_k", gguf.GGMLQuantizationType.Q5_K: "q5_k",
            gguf.GGMLQuantizationType.Q6_K: "q6_k"}

class ConversionError(ValueError):
    """The GGUF file holds something this converter does not handle (architecture, tokenizer, tensor)."""


@dataclass(frozen=True)
class Hyper:
    """The hyperparameters read from the GGUF metadata (`<arch>.*` keys)."""

    n_layers: int
    dim: int
    ffn_dim: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    vocab_size: int
    norm_eps: float
    rope_theta: float
    context_length: int
    arch: str = "llama"


class _Meta:
    """Typed access to a GGUFReader's key/value fields."""

    def __init__(self, reader: gguf.GGUFReader) -> None:
        self.reader = reader

    def has(self, key: str) -> bool:
        return key in self.reader.fields

    def get(self, key: str, default: Any = None) -> Any:
        field = self.reader.fields.get(key)
        return default if field is None else field.contents()

    def need(self, key: str) -> Any:
        if key not in self.reader.fields:
            raise ConversionError(f"GGUF metadata key {key!r} is missing (expected for a llama-architecture file)")
        return self.reader.fields[key].contents()


def _f32(x: float) -> float:
    """The shortest decimal that is the same float32 (9.999999747e-06 -> 1e-05), as Hugging Face configs write it."""
    return float(str(np.float32(x)))


def read_hyper(meta: _Meta, arch: str, n_tokens: int) -> Hyper:
    dim = int(meta.need(f"{arch}.embedding_length"))
    n_heads = int(meta.need(f"{arch}.attention.head_count"))
    rotary = dim // n_heads if arch == "phi3" else meta.get(f"{arch}.rope.dimension_count", dim // n_heads)
    head_dim = int(meta.get(f"{arch}.attention.key_length", rotary))
    return Hyper(
        n_layers=int(meta.need(f"{arch}.block_count")),
        dim=dim,
        ffn_dim=int(meta.need(f"{arch}.feed_forward_length")),
        n_heads=n_heads,
        n_kv_heads=int(meta.get(f"{arch}.attention.head_count_kv", n_heads)),
        head_dim=head_dim,
        vocab_size=int(meta.get(f"{arch}.vocab_size", n_tokens)),
        norm_eps=_f32(meta.need(f"{arch}.attention.layer_norm_rms_epsilon")),
        rope_theta=_f32(meta.get(f"{arch}.rope.freq_base", 10000.0)),
        context_length=int(meta.get(f"{arch}.context_length", 2048)),
        arch=arch,
    )


def unpermute_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Inverse of convert_hf_to_gguf.py's `permute`: rows (n, hd/2, 2) interleaved -> HF's (n, 2, hd/2) halves."""
    if w.shape[0] % (2 * n_heads) != 0:
        raise ConversionError(f"cannot un-permute {w.shape[0]} rows into {n_heads} heads of even size")
    return w.reshape(n_heads, w.shape[0] // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def permute_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """convert_hf_to_gguf.py's `permute` (HF layout -> llama.cpp layout); used by tests and tiny GGUF writers."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def hf_tensor_name(name: str, arch: str = "llama") -> str:
    if name in GLOBAL_MAP:
        return GLOBAL_MAP[name]
    m = _LAYER_RE.fullmatch(name)
    table = layer_map(arch)
    if m is not None and m.group(2) in table:
        return f"model.layers.{m.group(1)}.{table[m.group(2)]}"
    raise ConversionError(f"GGUF tensor {name!r} has no Hugging Face {arch} equivalent")


def expected_shape(hf_name: str, h: Hyper) -> tuple[int, ...]:
    q, kv = h.n_heads * h.head_dim, h.n_kv_heads * h.head_dim
    table: dict[str, tuple[int, ...]] = {
        "embed_tokens.weight": (h.vocab_size, h.dim),
        "lm_head.weight": (h.vocab_size, h.dim),
        "norm.weight": (h.dim,),
        "input_layernorm.weight": (h.dim,),
        "post_attention_layernorm.weight": (h.dim,),
        "pre_feedforward_layernorm.weight": (h.dim,),
        "post_feedforward_layernorm.weight": (h.dim,),
        "qkv_proj.weight": (q + 2 * kv, h.dim),
        "gate_up_proj.weight": (2 * h.ffn_dim, h.dim),
        "q_proj.weight": (q, h.dim),
        "k_proj.weight": (kv, h.dim),
        "v_proj.weight": (kv, h.dim),
        "o_proj.weight": (h.dim, q),
        "q_proj.bias": (q,),
        "k_proj.bias": (kv,),
        "v_proj.bias": (kv,),
        "q_norm.weight": (h.head_dim,),
        "k_norm.weight": (h.head_dim,),
        "gate_proj.weight": (h.ffn_dim, h.dim),
        "up_proj.weight": (h.ffn_dim, h.dim),
        "down_proj.weight": (h.dim, h.ffn_dim),
    }
    return table[".".join(hf_name.split(".")[-2:])]


def _tensor(t: Any, h: Hyper, keep_quantized: bool) -> tuple[str, np.ndarray]:
    """One GGUF tensor as the folder holds it, HF name and [out, in] shape (checked), llama's q/k rows un-permuted,
    Gemma's norms back to w: float32 (any type gguf.quants reads, K-quants included, dequantized), or with
    keep_quantized a KEPT_QUANTIZED matrix as uint8 (out, in / block values * block bytes) blocks."""
    name = hf_tensor_name(t.name, h.arch)
    want = expected_shape(name, h)
    if keep_quantized and t.tensor_type in KEPT_QUANTIZED:
        w = np.asarray(t.data, dtype=np.uint8)
        shape = tuple(gguf.quants.quant_shape_from_byte_shape(w.shape, t.tensor_type))
    else:
        w = np.asarray(_dequantize(t), dtype=np.float32)
        shape = tuple(w.shape)
    if shape != want:
        raise ConversionError(f"tensor {t.name!r}: expected shape {want}, got {shape}")
    if h.arch == "llama" and ".q_proj." in name:  # a row permutation: whole quantized rows move unchanged
        w = unpermute_rows(w, h.n_heads)
    elif h.arch == "llama" and ".k_proj." in name:
        w = unpermute_rows(w, h.n_kv_heads)
    elif h.arch in GEMMAS and name.endswith("norm.weight"):  # stored as 1 + w; exact for w + 1 in [0.5, 2]
        w = np.subtract(w, np.float32(1.0), dtype=np.float32)
    return name, np.ascontiguousarray(w)


def _weights(reader: gguf.GGUFReader) -> list[Any]:
    return [t for t in reader.tensors if t.name != ROPE_FREQS]  # rope_freqs: the rope scaling (rope_scaling_of)


def _check_complete(names: set[str], h: Hyper) -> None:
    qk_norms = h.arch in ("qwen3", "gemma3")
    per_layer = [v for v in layer_map(h.arch).values() if v.endswith("weight") and (qk_norms or v not in QK_NORMS)]
    for name in ["model.embed_tokens.weight", "model.norm.weight"] + [
        f"model.layers.{i}.{v}" for i in range(h.n_layers) for v in per_layer
    ]:
        if name not in names:
            raise ConversionError(f"GGUF file lacks the tensor for {name!r}")


def _write_streamed(path: Path, reader: gguf.GGUFReader, h: Hyper, keep_quantized: bool, leave: set[str],
                    metadata: dict[str, str], progress: Progress | None) -> None:
    """A safetensors file of every tensor `_tensor` makes but `leave`'s, written one tensor at a time (the header
    from the tensors' shapes first), so memory holds one tensor however large the model: an 8B file's float32 is
    32 GB. Written to a temp name and renamed into place."""
    weights = [t for t in _weights(reader) if hf_tensor_name(t.name, h.arch) not in leave]
    header: dict[str, Any] = {"__metadata__": metadata}
    offset = 0
    for t in weights:
        name = hf_tensor_name(t.name, h.arch)
        if keep_quantized and t.tensor_type in KEPT_QUANTIZED:
            dtype, shape = "U8", tuple(int(x) for x in np.asarray(t.data).shape)
        else:
            dtype, shape = "F32", expected_shape(name, h)
        size = int(np.prod(shape)) * (1 if dtype == "U8" else 4)
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data 8-byte aligned, as safetensors' own writer leaves it
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for n, t in enumerate(weights):
            name, w = _tensor(t, h, keep_quantized)
            entry = header[name]
            if list(w.shape) != entry["shape"] or w.dtype != (np.uint8 if entry["dtype"] == "U8" else np.float32):
                raise ConversionError(f"tensor {t.name!r}: read as {w.dtype} {w.shape}, expected {entry}")
            w.tofile(f)
            if progress is not None:
                progress(n + 1, len(weights))
    tmp.replace(path)


def _dequantize(t: Any) -> np.ndarray:
    """float32 values of a GGUF tensor of any type gguf.quants reads; ConversionError naming the type otherwise."""
    if t.tensor_type in K_QUANTS:  # webchat's own decoder (webchat.model.quant.dequantize_k)
        import torch

        from webchat.gguf.blocks import dequantize_k

        blocks = torch.from_numpy(np.array(t.data, dtype=np.uint8))
        return dequantize_k(blocks.reshape(blocks.shape[0], -1), K_QUANTS[t.tensor_type]).numpy()
    try:
        return np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32)
    except NotImplementedError:
        kind = gguf.GGMLQuantizationType(t.tensor_type).name
        raise ConversionError(f"tensor {t.name!r} is of ggml type {kind}, which webchat cannot read") from None


ROPE_FREQS = "rope_freqs.weight"  # llama.cpp's llama3 rope scaling: per frequency, the divisor of inv_freq
LLAMA3_GUESSES = [(8192, 1.0, 4.0)]  # (original context, low_freq_factor, high_freq_factor) of Llama 3.1/3.2/3.3


def llama3_factors(h: Hyper, factor: float, old_ctx: int, low: float, high: float) -> np.ndarray:
    """convert_hf_to_gguf.py's rope_freqs for llama3 scaling (LlamaModel.generate_extra_tensors)."""
    freqs = 1.0 / (h.rope_theta ** (np.arange(0, h.head_dim, 2, dtype=np.float64) / h.head_dim))
    out = []
    for freq in freqs:
        wavelen = 2 * np.pi / freq
        if wavelen < old_ctx / high:
            out.append(1.0)
        elif wavelen > old_ctx / low:
            out.append(factor)
        else:
            smooth = (old_ctx / wavelen - low) / (high - low)
            out.append(1.0 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def rope_scaling_of(reader: gguf.GGUFReader, h: Hyper) -> dict[str, Any] | None:
    """Hugging Face's llama3 rope_scaling for a GGUF's rope_freqs.weight (None without one): its largest divisor is
    the factor; the other parameters are Llama 3's, checked against every divisor."""
    t = next((t for t in reader.tensors if t.name == ROPE_FREQS), None)
    if t is None:
        return None
    got = np.asarray(_dequantize(t), dtype=np.float32).reshape(-1)
    factor = float(got.max())
    for old_ctx, low, high in LLAMA3_GUESSES:
        want = llama3_factors(h, factor, old_ctx, low, high)
        if want.shape == got.shape and np.allclose(got, want, rtol=1e-5, atol=0):
            return {"rope_type": "llama3", "factor": _f32(factor), "low_freq_factor": low, "high_freq_factor": high,
                    "original_max_position_embeddings": old_ctx}
    raise ConversionError(f"GGUF tensor {ROPE_FREQS!r} is not Llama 3's rope scaling (factor {factor:g}, "
                          f"original context {LLAMA3_GUESSES[0][0]}); webchat cannot read other rope scalings")


def quantized_types(reader: gguf.GGUFReader) -> dict[str, str]:
    """{HF tensor name: "q4_1", ...} for the tensors kept as blocks (`_tensor` with keep_quantized)."""
    kept = [t for t in reader.tensors if t.tensor_type in KEPT_QUANTIZED]
    arch = str(_Meta(reader).get("general.architecture"))
    return {hf_tensor_name(t.name, arch): KEPT_QUANTIZED[t.tensor_type] for t in kept}


def write_quantized(reader: gguf.GGUFReader, h: Hyper, out_dir: Path, progress: Progress | None = None) -> None:
    """out_dir/quantized.safetensors (docs/quant.md), written to a temp name and renamed into place."""
    meta = {"format": "pt", QUANT_KEY: json.dumps(quantized_types(reader)), QUANT_LAYOUT_KEY: QUANT_LAYOUT}
    _write_streamed(out_dir / QUANT_FILE, reader, h, True, set(), meta, progress)


def add_quantized(gguf_path: Path, out_dir: Path) -> None:
    """Add quantized.safetensors to a folder converted before it existed (same GGUF, same names)."""
    reader = open_gguf(gguf_path)
    meta = _Meta(reader)
    arch = str(meta.get("general.architecture"))
    write_quantized(reader, read_hyper(meta, arch, len(meta.need("tokenizer.ggml.tokens"))), out_dir)


def model_config(meta: _Meta, h: Hyper, tied: bool, bias: bool,
                 rope_scaling: dict[str, Any] | None = None) -> dict[str, Any]:
    eos = meta.get("tokenizer.ggml.eos_token_id")
    base = {
        "architectures": [HF_ARCHS[h.arch][0]],
        "model_type": HF_ARCHS[h.arch][1],
        "vocab_size": h.vocab_size,
        "hidden_size": h.dim,
        "intermediate_size": h.ffn_dim,
        "num_hidden_layers": h.n_layers,
        "num_attention_heads": h.n_heads,
        "num_key_value_heads": h.n_kv_heads,
        "head_dim": h.head_dim,
        "rms_norm_eps": h.norm_eps,
        "rope_theta": h.rope_theta,
        "rope_scaling": rope_scaling,
        "max_position_embeddings": h.context_length,
        "tie_word_embeddings": tied,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": None if eos is None else int(eos),
        "pad_token_id": meta.get("tokenizer.ggml.padding_token_id"),
        "hidden_act": "silu",
        "attention_bias": bias,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "initializer_range": 0.02,
        "use_cache": True,
        "torch_dtype": "float32",
    }
    return {**base, **arch_config(meta, h)}


def arch_config(meta: _Meta, h: Hyper) -> dict[str, Any]:
    """The config.json keys beyond a Llama's, from the `<arch>.*` keys and llama.cpp's defaults for them."""
    a, n = h.arch, h.n_layers
    if a in GEMMAS:
        big = n == {"gemma2": 46, "gemma3": 62}[a]  # llama.cpp's 27B: queries scaled by 1/sqrt(dim / heads)
        window = int(meta.get(f"{a}.attention.sliding_window", 4096 if a == "gemma2" else 0))
        pattern = meta.get(f"{a}.attention.sliding_window_pattern", 2 if a == "gemma2" else 6)
        swa = ([bool(x) for x in pattern] if isinstance(pattern, list)
               else [pattern == 0 or i % pattern < pattern - 1 for i in range(n)])  # llama.cpp's set_swa_pattern
        if len(swa) != n:
            raise ConversionError(f"{a}.attention.sliding_window_pattern names {len(swa)} layers, the file has {n}")
        out: dict[str, Any] = {
            "hidden_act": "gelu_pytorch_tanh", "hidden_activation": "gelu_pytorch_tanh",
            "query_pre_attn_scalar": h.dim // h.n_heads if big else h.head_dim,
            "sliding_window": window or None,
            "layer_types": ["sliding_attention" if s and window else "full_attention" for s in swa],
        }
        if a == "gemma2":
            out["attn_logit_softcapping"] = _f32(meta.get("gemma2.attn_logit_softcapping", 50.0))
            out["final_logit_softcapping"] = _f32(meta.get("gemma2.final_logit_softcapping", 30.0))
            return out
        cap = meta.get("gemma3.final_logit_softcapping")
        full: dict[str, Any] = {"rope_type": "default", "rope_theta": h.rope_theta}
        kind = meta.get("gemma3.rope.scaling.type")
        if kind == "linear":
            full = {"rope_type": "linear", "factor": _f32(meta.need("gemma3.rope.scaling.factor")),
                    "rope_theta": h.rope_theta}
        elif kind not in (None, "none"):
            raise ConversionError(f"gemma3.rope.scaling.type {kind!r} is not supported; expected linear")
        local = {"rope_type": "default", "rope_theta": _f32(meta.get("gemma3.rope.freq_base_swa", 10000.0))}
        return {**out, "attn_logit_softcapping": None, "final_logit_softcapping": _f32(cap) if cap else None,
                "rope_scaling": None, "rope_parameters": {"full_attention": full, "sliding_attention": local}}
    if a == "phi3":
        rotary = int(meta.get("phi3.rope.dimension_count", h.head_dim))
        if rotary != h.head_dim:
            raise ConversionError(f"phi3.rope.dimension_count {rotary} is not the head size {h.head_dim}: partial "
                                  "rotary embeddings are not supported; webchat rotates the whole head")
        window = int(meta.get("phi3.attention.sliding_window", 0))
        return {"sliding_window": window or None, "partial_rotary_factor": 1.0,
                "original_max_position_embeddings": int(meta.get("phi3.rope.scaling.original_context_length",
                                                                 h.context_length))}
    return {}


def _write_json(path: Path, obj: dict[str, Any]) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def open_gguf(gguf_path: Path) -> gguf.GGUFReader:
    """A GGUFReader, or ConversionError in one line for a file that is not GGUF (or not a version gguf reads). The
    bounded reader (webchat.gguf.header) checks the header first: gguf's reader trusts every count in it."""
    try:
        read_header(gguf_path, keep=keep_none)
    except GGUFError as e:
        raise ConversionError(str(e)) from None
    try:
        return gguf.GGUFReader(gguf_path)
    except (ValueError, IndexError, TypeError) as e:
        raise ConversionError(f"{gguf_path.name}: not a GGUF file webchat can read ({e})") from None


def convert_gguf(gguf_path: Path, out_dir: Path, progress: Progress | None = None) -> None:
    """Write config.json, model.safetensors, tokenizer.json, tokenizer_config.json, generation_config.json, and
    quantized.safetensors where the GGUF holds matrices of a KEPT_QUANTIZED type. progress(done, total) per tensor read
    (each is read twice where the quantized file is written)."""
    reader = open_gguf(gguf_path)
    meta = _Meta(reader)
    arch = meta.get("general.architecture")
    if arch not in SUPPORTED_ARCHS:
        raise ConversionError(
            f"{gguf_path.name}: architecture {arch!r} is not supported; expected one of {SUPPORTED_ARCHS}"
        )
    tokens: list[str] = meta.need("tokenizer.ggml.tokens")
    h = read_hyper(meta, arch, len(tokens))
    longrope = [t.name for t in reader.tensors if t.name in ROPE_FACTORS]
    if longrope:
        raise ConversionError(f"{gguf_path.name}: {longrope[0]!r} is Phi-3's longrope scaling, which webchat does not "
                              "run")
    fields = Fields({k: meta.get(k) for k in reader.fields if k.startswith("tokenizer.ggml.")})
    try:
        tokenizer: HFTokenizer = build_tokenizer(fields)  # before the tensors: refuse an unsupported one cheaply
        specials = special_tokens(fields)
    except VocabError as e:
        raise ConversionError(f"{gguf_path.name}: {e}") from None
    arch_config(meta, h)  # likewise an unsupported rope or window setting
    scaling = rope_scaling_of(reader, h)  # likewise an unknown rope scaling
    kept = quantized_types(reader)
    names = {hf_tensor_name(t.name, arch) for t in _weights(reader)}
    _check_complete(names, h)
    tied = "lm_head.weight" not in names
    bias = any(name.endswith("_proj.bias") for name in names)
    # past FLOAT_FILE_LIMIT the block matrices stay in quantized.safetensors only; the float path decodes them at load
    floats = sum(4 * int(np.prod(expected_shape(name, h))) for name in names)
    leave = set(kept) if kept and floats > FLOAT_FILE_LIMIT else set()
    header = {"format": "pt", **({FLOATS_IN_BLOCKS_KEY: QUANT_FILE} if leave else {})}
    passes = 2 if kept else 1  # the float tensors, then the quantized file's
    out_dir.mkdir(parents=True, exist_ok=True)
    _write_streamed(out_dir / "model.safetensors", reader, h, False, leave, header,
                    None if progress is None else lambda i, n: progress(i, n * passes))
    if kept:
        write_quantized(reader, h, out_dir, None if progress is None else lambda i, n: progress(n + i, 2 * n))
    tokenizer.save(str(out_dir / "tokenizer.json"))
    config = model_config(meta, h, tied, bias, scaling)
    _write_json(out_dir / "config.json", config)
    spm = meta.get("tokenizer.ggml.model") == "llama"  # llama.cpp adds BOS to a SentencePiece vocabulary by default
    tok_config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", spm)),
        "add_eos_token": bool(meta.get("tokenizer.ggml.add_eos_token", False)),
        "clean_up_tokenization_spaces": False,
        "model_max_length": h.context_length,
        **specials,
    }
    template = meta.get("tokenizer.chat_template")
    if template is not None:
        tok_config["chat_template"] = str(template)
    _write_json(out_dir / "tokenizer_config.json", tok_config)
    gen_keys = ("bos_token_id", "eos_token_id", "pad_token_id")
    _write_json(out_dir / "generation_config.json", {k: config[k] for k in gen_keys if config[k] is not None})
