"""Model configuration: one dataclass read from a checkpoint's config.json by exact key."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SUPPORTED_ARCHS = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")


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

    @classmethod
    def from_dict(cls, cfg: dict[str, Any], name: str = "") -> ModelArgs:
        archs = cfg.get("architectures") or []
        arch = archs[0] if archs else ""
        if arch not in SUPPORTED_ARCHS:
            raise ModelConfigError(f"unsupported architecture {arch!r}; webchat runs {', '.join(SUPPORTED_ARCHS)}")
        for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size"):
            if key not in cfg:
                raise ModelConfigError(f"config.json has no {key!r}")
        if cfg.get("hidden_act", "silu") != "silu":
            raise ModelConfigError(f"unsupported hidden_act {cfg['hidden_act']!r}; expected 'silu'")
        # transformers 5 writes rope settings as one `rope_parameters` dict; older checkpoints use two keys
        rope = cfg.get("rope_parameters") or {}
        rope_theta = cfg.get("rope_theta", rope.get("rope_theta", 10000.0))
        rope_scaling = cfg.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
        eos = cfg.get("eos_token_id")
        eos_ids = [] if eos is None else (list(eos) if isinstance(eos, list) else [eos])
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
        )

    @classmethod
    def from_dir(cls, path: Path) -> ModelArgs:
        cfg_path = path / "config.json"
        if not cfg_path.is_file():
            raise FileNotFoundError(f"no config.json in model folder {path}")
        return cls.from_dict(json.loads(cfg_path.read_text()), name=path.name)
