"""A Llama-family transformer (Llama, Mistral, Qwen2) for one sequence, with its hot ops behind `ops`."""

from __future__ import annotations

import copy
import dataclasses
import math
from typing import Any, cast

import torch
from torch import nn

from webchat.cache import KVCache
from webchat.config import ModelArgs, ModelConfigError
from webchat.ops import TorchOps


class Attention(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        hd, bias = args.head_dim, args.qkv_bias
        self.n_heads, self.n_kv_heads, self.head_dim = args.n_heads, args.n_kv_heads, hd
        self.wq = nn.Linear(args.dim, args.n_heads * hd, bias=bias)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * hd, bias=bias)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * hd, bias=bias)
        self.wo = nn.Linear(args.n_heads * hd, args.dim, bias=False)

    def forward(
        self, x: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor, start: int, rope: tuple[torch.Tensor, ...],
        ops: Any,
    ) -> torch.Tensor:
        t = x.shape[0]
        q = self.wq(x).view(t, self.n_heads, self.head_dim)  # (T, H, hd)
        k = self.wk(x).view(t, self.n_kv_heads, self.head_dim)  # (T, n_kv, hd)
        v = self.wv(x).view(t, self.n_kv_heads, self.head_dim)
        q, k = ops.rope(q, k, *rope)
        ops.kv_append(cache_k, cache_v, k, v, start)
        o = ops.attention(q, cache_k, cache_v, start)  # (T, H, hd)
        out: torch.Tensor = self.wo(o.reshape(t, self.n_heads * self.head_dim))
        return out


class FeedForward(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.w1 = nn.Linear(args.dim, args.ffn_dim, bias=False)  # gate
        self.w3 = nn.Linear(args.dim, args.ffn_dim, bias=False)  # up
        self.w2 = nn.Linear(args.ffn_dim, args.dim, bias=False)  # down

    def forward(self, x: torch.Tensor, ops: Any) -> torch.Tensor:
        out: torch.Tensor = self.w2(ops.silu_mul(self.w1(x), self.w3(x)))
        return out


class RMSNorm(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))


class Block(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.attention = Attention(args)
        self.feed_forward = FeedForward(args)
        self.attention_norm = RMSNorm(args.dim)
        self.ffn_norm = RMSNorm(args.dim)


class Transformer(nn.Module):
    """Forward a chunk of tokens at positions cache.length.. and return float32 logits (docs/design.md)."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        self.ops: Any = TorchOps
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(Block(args) for _ in range(args.n_layers))
        self.norm = RMSNorm(args.dim)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        self.rope_cos = torch.empty(0)
        self.rope_sin = torch.empty(0)
        # CUDA backend hook (webchat.cuda_backend.GraphRunner): replays captured CUDA graphs; None = always eager
        self.runner: Any = None

    @property
    def device(self) -> torch.device:
        return self.tok_embeddings.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.norm.weight.dtype  # the embedding may be quantized (uint8 blocks, webchat.quant)

    def setup_rope(self, n_positions: int) -> None:
        """Precompute cos/sin (n_positions, head_dim/2) in float32 on the model's device."""
        inv_freq = rope_inv_freq(self.args).to(self.device)
        freqs = torch.outer(torch.arange(n_positions, device=self.device, dtype=torch.float32), inv_freq)
        self.rope_cos, self.rope_sin = freqs.cos(), freqs.sin()

    def new_cache(self, max_seq_len: int | None = None) -> KVCache:
        capacity = max_seq_len or self.args.max_seq_len
        if capacity > self.rope_cos.shape[0]:
            self.setup_rope(capacity)
        return KVCache(self.args, capacity, self.device, self.dtype)

    def truncated(self, n_layers: int) -> Transformer:
        """The first n_layers blocks plus the final norm and head, sharing weights (a self-draft model)."""
        if not 0 < n_layers <= self.args.n_layers:
            raise ValueError(f"n_layers must be in [1, {self.args.n_layers}], got {n_layers}")
        small = copy.copy(self)
        small._modules = dict(self._modules)
        small._modules["layers"] = nn.ModuleList(list(self.layers)[:n_layers])
        small.args = dataclasses.replace(self.args, n_layers=n_layers)
        return small

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, cache: KVCache, last_only: bool = False) -> torch.Tensor:
        t, start = tokens.shape[0], cache.length
        if tokens.dim() != 1 or t == 0:
            raise ValueError(f"tokens must be a non-empty 1-D tensor, got shape {tuple(tokens.shape)}")
        if start + t > cache.capacity:
            raise ValueError(f"{t} tokens at position {start} overflow the cache of {cache.capacity}")
        if len(cache.k) != len(self.layers):
            raise ValueError(f"cache has {len(cache.k)} layers, model has {len(self.layers)}")
        if self.runner is not None:
            logits = self.runner(self, tokens, cache, last_only)  # None: not a graphed step, run eagerly
            if logits is not None:
                return logits  # type: ignore[no-any-return]
        rope = (self.rope_cos[start : start + t], self.rope_sin[start : start + t])
        logits = self.layers_forward(tokens, cache, start, rope, last_only)
        cache.length = start + t
        return logits

    def layers_forward(
        self, tokens: torch.Tensor, cache: KVCache, start: int | torch.Tensor, rope: tuple[torch.Tensor, ...],
        last_only: bool,
    ) -> torch.Tensor:
        """Blocks, final norm and head for tokens at positions start..; leaves cache.length alone.

        start may be a one-element int32 CUDA tensor (with CudaOps), so a captured CUDA graph replays at any position.
        """
        ops, eps = self.ops, self.args.norm_eps
        residual = self.tok_embeddings(tokens)  # (T, dim)
        out: torch.Tensor | None = None
        for i, layer in enumerate(cast(list[Block], list(self.layers))):
            if out is None:
                y = ops.rms_norm(residual, layer.attention_norm.weight, eps)
            else:
                y, residual = ops.add_rms_norm(out, residual, layer.attention_norm.weight, eps)
            out = layer.attention(y, cache.k[i], cache.v[i], start, rope, ops)
            y, residual = ops.add_rms_norm(out, residual, layer.ffn_norm.weight, eps)
            out = layer.feed_forward(y, ops)
        assert out is not None
        if last_only:
            out, residual = out[-1:], residual[-1:]
        y, _ = ops.add_rms_norm(out, residual, self.norm.weight, eps)
        logits: torch.Tensor = self.output(y).float()  # (T, vocab)
        return logits


def rope_inv_freq(args: ModelArgs) -> torch.Tensor:
    """inv_freq[i] = theta^(-2i/hd), adjusted for rope scaling of the `linear` or `llama3` kind."""
    hd = args.head_dim
    inv_freq = 1.0 / (args.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.int64).float() / hd))
    scaling = args.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    if kind == "llama3":
        return _llama3_inv_freq(inv_freq, scaling)
    raise ModelConfigError(f"unsupported rope_scaling type {kind!r}; webchat supports default, linear and llama3")


def _llama3_inv_freq(inv_freq: torch.Tensor, s: dict[str, Any]) -> torch.Tensor:
    factor, low, high = float(s["factor"]), float(s["low_freq_factor"]), float(s["high_freq_factor"])
    old_ctx = float(s["original_max_position_embeddings"])
    low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)
