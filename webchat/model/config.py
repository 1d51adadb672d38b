"""Model configuration: one dataclass read from a checkpoint's config.json by exact key."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SUPPORTED_ARCHS = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                   "Phi3ForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM")
GEMMA = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")
QK_NORM = ("Qwen3ForCausalLM", "Gemma3ForCausalLM")
ROPE_TYPES = ("default", "linear", "llama3")  # webchat.model.transformer.rope_inv_freq
ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh"}  # config's hidden_act → ours
# what a model may compute beyond a Llama block (ModelArgs.beyond_llama), all of which the C++ forward and the CUDA
# kernels run; a name outside it makes them decline (webchat.kernels.cpu.step, webchat.kernels.cuda.graphs)
BEYOND_LLAMA = ("q/k norms", "pre/post norms", "an embedding scale", "gelu_tanh MLP", "attention scale",
                "attention soft-capping", "final soft-capping", "sliding-window layers", "local rope")


class ModelConfigError(ValueError):
    """A config.json that webchat cannot run."""


@dataclass
class ModelArgs:
    arch: str
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    ffn_dim: int
    vocab_size: int
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_seq_len: int = 2048
    tie_embeddings: bool = False
    qkv_bias: bool = False
    head_dim: int = 0  # 0: dim // n_heads
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    name: str = ""
    # beyond Llama: Qwen3 and Gemma 3 q/k norms; Gemma's (1+w) norms, √dim embedding scale, pre/post norms
    qk_norm: bool = False
    norm_plus_one: bool = False  # the loader adds 1 to every norm weight: rms_norm(x) * (1 + w)
    sandwich_norm: bool = False  # post-attention and post-FFN norms on each block's outputs
    embed_scale: float = 1.0
    act: str = "silu"  # silu | gelu_tanh
    attn_scale: float = 0.0  # 0: head_dim ** -0.5
    attn_softcap: float = 0.0  # scores = cap * tanh(scores / cap); 0: none
    final_softcap: float = 0.0  # logits = cap * tanh(logits / cap); 0: none
    layer_windows: list[int] = field(default_factory=list)  # per layer: attend to the last w positions; 0: all
    rope_local: dict[str, Any] | None = None  # Gemma 3's sliding layers: {"rope_theta": ..., "rope_type": ...}

    def __post_init__(self) -> None:
        if self.head_dim == 0:
            if self.dim % self.n_heads:
                raise ModelConfigError(f"hidden_size {self.dim} is not divisible by num_attention_heads {self.n_heads}")
            self.head_dim = self.dim // self.n_heads
        if self.n_heads % self.n_kv_heads:
            raise ModelConfigError(
                f"num_attention_heads {self.n_heads} is not a multiple of num_key_value_heads {self.n_kv_heads}"
            )
        if self.head_dim % 2:
            raise ModelConfigError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        for scaling in (self.rope_scaling, self.rope_local):
            kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
            if kind not in ROPE_TYPES:  # before any weight loads (Phi-3 128k's longrope, YaRN, ...)
                supported = ", ".join(ROPE_TYPES)
                raise ModelConfigError(f"unsupported rope_scaling type {kind!r}; webchat supports {supported}")
        if self.attn_scale == 0.0:
            self.attn_scale = self.head_dim ** -0.5
        if not self.layer_windows:
            self.layer_windows = [0] * self.n_layers
        if len(self.layer_windows) != self.n_layers:
            raise ModelConfigError(f"layer_types names {len(self.layer_windows)} layers, the model has {self.n_layers}")

    @property
    def beyond_llama(self) -> list[str]:  # each a name in BEYOND_LLAMA
        """What this model computes that a Llama block does not (empty for Llama, Mistral, Qwen2, Phi-3)."""
        parts = [("q/k norms", self.qk_norm), ("pre/post norms", self.sandwich_norm),
                 ("an embedding scale", self.embed_scale != 1.0), (f"{self.act} MLP", self.act != "silu"),
                 ("attention scale", abs(self.attn_scale - self.head_dim ** -0.5) > 1e-12),
                 ("attention soft-capping", self.attn_softcap > 0), ("final soft-capping", self.final_softcap > 0),
                 ("sliding-window layers", any(self.layer_windows)), ("local rope", self.rope_local is not None)]
        return [name for name, on in parts if on]

    @classmethod
    def from_dict(cls, cfg: dict[str, Any], name: str = "") -> ModelArgs:
        archs = cfg.get("architectures") or []
        arch = archs[0] if archs else ""
        if arch not in SUPPORTED_ARCHS:
            raise ModelConfigError(f"unsupported architecture {arch!r}; webchat runs {', '.join(SUPPORTED_ARCHS)}")
        for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size"):
            if key not in cfg:
                raise ModelConfigError(f"config.json has no {key!r}")
        act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "silu"
        if act not in ACTIVATIONS:
            raise ModelConfigError(f"unsupported hidden_act {act!r}; expected one of {', '.join(ACTIVATIONS)}")
        # transformers 5 writes rope settings as one `rope_parameters` dict (Gemma 3: one per layer type); older
        # checkpoints use rope_theta and rope_scaling (Gemma 3: rope_local_base_freq for the sliding layers)
        rope = cfg.get("rope_parameters") or {}
        local: dict[str, Any] | None = None
        if "full_attention" in rope:
            rope, local = rope["full_attention"], rope.get("sliding_attention")
        elif "rope_local_base_freq" in cfg:
            local = {"rope_type": "default", "rope_theta": cfg["rope_local_base_freq"]}
        if float(rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))) != 1.0:
            raise ModelConfigError("partial_rotary_factor != 1.0 is not supported; webchat rotates the whole head")
        rope_theta = cfg.get("rope_theta", rope.get("rope_theta", 10000.0))
        rope_scaling = cfg.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
        eos = cfg.get("eos_token_id")
        eos_ids = [] if eos is None else (list(eos) if isinstance(eos, list) else [eos])
        gemma = arch in GEMMA
        return cls(
            arch=arch,
            dim=cfg["hidden_size"],
            n_layers=cfg["num_hidden_layers"],
            n_heads=cfg["num_attention_heads"],
            n_kv_heads=cfg.get("num_key_value_heads") or cfg["num_attention_heads"],
            ffn_dim=cfg["intermediate_size"],
            vocab_size=cfg["vocab_size"],
            norm_eps=cfg.get("rms_norm_eps", 1e-5),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_seq_len=cfg.get("max_position_embeddings", 2048),
            tie_embeddings=cfg.get("tie_word_embeddings", False),
            qkv_bias=arch == "Qwen2ForCausalLM" or bool(cfg.get("attention_bias", False)),
            head_dim=cfg.get("head_dim") or 0,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            name=name,
            qk_norm=arch in QK_NORM,
            norm_plus_one=gemma,
            sandwich_norm=gemma,
            embed_scale=cfg["hidden_size"] ** 0.5 if gemma else 1.0,
            act=ACTIVATIONS[act],
            attn_scale=cfg["query_pre_attn_scalar"] ** -0.5 if gemma and cfg.get("query_pre_attn_scalar") else 0.0,
            attn_softcap=float(cfg.get("attn_logit_softcapping") or 0.0) if gemma else 0.0,
            final_softcap=float(cfg.get("final_logit_softcapping") or 0.0) if gemma else 0.0,
            layer_windows=_layer_windows(cfg, arch),
            rope_local=local if gemma else None,
        )

    @classmethod
    def from_dir(cls, path: Path) -> ModelArgs:
        cfg_path = path / "config.json"
        if not cfg_path.is_file():
            raise FileNotFoundError(f"no config.json in model folder {path}")
        return cls.from_dict(json.loads(cfg_path.read_text()), name=path.name)


def _layer_windows(cfg: dict[str, Any], arch: str) -> list[int]:
    """Per layer the sliding window (0: full attention), from `layer_types` (transformers 5) or Gemma's pattern."""
    window = int(cfg.get("sliding_window") or 0)
    n = int(cfg["num_hidden_layers"])
    types = cfg.get("layer_types")
    if types is None and arch == "Gemma2ForCausalLM":
        types = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)]
    elif types is None and arch == "Gemma3ForCausalLM":
        pattern = int(cfg.get("sliding_window_pattern", 6))
        types = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(n)]
    if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM") and not cfg.get("use_sliding_window", False):
        types = None
    elif types is None and arch in ("MistralForCausalLM", "Phi3ForCausalLM"):  # one window for every layer
        types = ["sliding_attention"] * n
    if not types or not window:
        return [0] * n
    bad = sorted({t for t in types if t not in ("sliding_attention", "full_attention")})
    if bad:
        raise ModelConfigError(f"unsupported layer_types {bad}; expected sliding_attention or full_attention")
    return [window if t == "sliding_attention" else 0 for t in types]
