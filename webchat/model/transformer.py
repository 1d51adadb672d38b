"""A Llama-family transformer (Llama, Mistral, Qwen2/3, Phi-3, Gemma 2/3) on a paged KV cache, hot ops behind `ops`."""

from __future__ import annotations

import copy
import dataclasses
import math
from collections.abc import Callable
from typing import Any, Protocol, cast

import torch
from torch import nn

from webchat.model.batch import Batch
from webchat.model.config import ModelArgs, ModelConfigError
from webchat.model.kv_cache import PAGE_SIZE, KVPool, SeqCache
from webchat.model.ops import PagedTorchOps
from webchat.model.quant import exact_mask, exact_rows


class PagedKV(Protocol):
    """Per layer k and v pages, each (num_pages, page_size, n_kv, hd): a webchat.model.kv_cache.KVPool."""

    k: list[torch.Tensor]
    v: list[torch.Tensor]


class Ops(Protocol):
    """The hot ops the model calls (webchat.model.ops.PagedTorchOps; webchat.kernels.cuda.CudaOps on a GPU)."""

    def rms_norm(self, x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor: ...
    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, w: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]: ...
    def rope(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
             sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...
    def silu_mul(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor: ...
    def gelu_tanh_mul(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor: ...
    def kv_write(self, k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None: ...
    def paged_attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: Batch, *,
                        scale: float | None = None, softcap: float = 0.0, window: int = 0) -> torch.Tensor: ...


class RMSNorm(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, window: int = 0) -> None:
        super().__init__()
        hd, bias = args.head_dim, args.qkv_bias
        self.n_heads, self.n_kv_heads, self.head_dim = args.n_heads, args.n_kv_heads, hd
        self.wq = nn.Linear(args.dim, args.n_heads * hd, bias=bias)
        self.wk = nn.Linear(args.dim, args.n_kv_heads * hd, bias=bias)
        self.wv = nn.Linear(args.dim, args.n_kv_heads * hd, bias=bias)
        self.wo = nn.Linear(args.n_heads * hd, args.dim, bias=False)
        self.q_norm = RMSNorm(hd) if args.qk_norm else None  # Qwen3, Gemma 3: per head, before rope
        self.k_norm = RMSNorm(hd) if args.qk_norm else None
        self.eps, self.scale, self.softcap, self.window = args.norm_eps, args.attn_scale, args.attn_softcap, window
        self.default_scale = abs(self.scale - hd ** -0.5) < 1e-12

    def forward(
        self, x: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: Batch,
        rope: tuple[torch.Tensor, torch.Tensor], ops: Ops,
    ) -> torch.Tensor:
        t = x.shape[0]
        q = self.wq(x).view(t, self.n_heads, self.head_dim)  # (T, H, hd)
        k = self.wk(x).view(t, self.n_kv_heads, self.head_dim)  # (T, n_kv, hd)
        v = self.wv(x).view(t, self.n_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:  # per head: rows of head_dim
            q = ops.rms_norm(q.reshape(-1, self.head_dim), self.q_norm.weight, self.eps).view_as(q)
            k = ops.rms_norm(k.reshape(-1, self.head_dim), self.k_norm.weight, self.eps).view_as(k)
        q, k = ops.rope(q, k, *rope)
        ops.kv_write(k_cache, v_cache, k, v, batch.slot_mapping)
        o = ops.paged_attention(q, k_cache, v_cache, batch, scale=None if self.default_scale else self.scale,
                                softcap=self.softcap, window=self.window)  # (T, H, hd)
        out: torch.Tensor = self.wo(o.reshape(t, self.n_heads * self.head_dim))
        return out


class FeedForward(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.w1 = nn.Linear(args.dim, args.ffn_dim, bias=False)  # gate
        self.w3 = nn.Linear(args.dim, args.ffn_dim, bias=False)  # up
        self.w2 = nn.Linear(args.ffn_dim, args.dim, bias=False)  # down
        self.act = args.act

    def forward(self, x: torch.Tensor, ops: Ops) -> torch.Tensor:
        if self.act == "gelu_tanh":  # Gemma: y = w2(gelu_tanh(w1 x) * w3 x)
            h = ops.gelu_tanh_mul(self.w1(x), self.w3(x))
        else:
            h = ops.silu_mul(self.w1(x), self.w3(x))
        out: torch.Tensor = self.w2(h)
        return out


class Block(nn.Module):
    def __init__(self, args: ModelArgs, window: int = 0) -> None:
        super().__init__()
        self.attention = Attention(args, window)
        self.feed_forward = FeedForward(args)
        self.attention_norm = RMSNorm(args.dim)
        self.ffn_norm = RMSNorm(args.dim)
        # Gemma 2/3: norms on the attention and FFN outputs before they join the residual
        self.attention_post_norm = RMSNorm(args.dim) if args.sandwich_norm else None
        self.ffn_post_norm = RMSNorm(args.dim) if args.sandwich_norm else None
        self.local_rope = window > 0 and args.rope_local is not None


Runner = Callable[["Transformer", Batch, PagedKV], "torch.Tensor | None"]


class Transformer(nn.Module):
    """model(batch, kv) -> float32 logits (R, vocab) of batch.logit_rows, after writing every token's k/v into kv.

    Positions come in with the batch (rope rows gathered by batch.positions); the model never reads or advances
    cache lengths: the caller (webchat.engine.engine) does, in one place.
    """

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        self.ops: Ops = PagedTorchOps()
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(Block(args, w) for w in args.layer_windows)
        self.norm = RMSNorm(args.dim)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        self.rope_cos = torch.empty(0)
        self.rope_sin = torch.empty(0)
        self.rope_local: tuple[torch.Tensor, torch.Tensor] | None = None  # Gemma 3's sliding layers
        # what a backend installs (webchat.kernels.cpu.step, webchat.kernels.cuda.graphs): runner(model, batch, kv) ->
        # logits, or None to run eagerly; sampler_factory(settings, vocab_size) -> a webchat.engine.sampling.Sampler
        # subclass that runs where the logits live (None: the engine's own torch Sampler); row_scan: the C++ scans of
        # CPU logits rows (webchat.engine.sampling.RowScan, by webchat.model.loader where the kernels are built);
        # suffix_index: the C++ class of the auto planner's suffix index (engine.spec.suffix.new_index), likewise
        self.runner: Runner | None = None
        self.sampler_factory: Callable[..., object] | None = None
        self.row_scan: Any = None
        self.suffix_index: Callable[..., Any] | None = None
        # the quantized matrices' activations: "exact" (float32), "int8" or "int8x2" (webchat.model.precision)
        self.precision = "exact"
        # how its pools store k and v (webchat.model.kv_format: "f32", "f16", "q8_0"); None: in the model's dtype
        self.kv_cache: str | None = None

    @property
    def device(self) -> torch.device:
        return self.tok_embeddings.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.norm.weight.dtype  # the embedding may be quantized (uint8 blocks, webchat.model.quant)

    def setup_rope(self, n_positions: int) -> None:
        """Precompute cos/sin (n_positions, head_dim/2) in float32 on the model's device."""
        pos = torch.arange(n_positions, device=self.device, dtype=torch.float32)
        freqs = torch.outer(pos, rope_inv_freq(self.args).to(self.device))
        self.rope_cos, self.rope_sin = freqs.cos(), freqs.sin()
        if self.args.rope_local is not None:
            local = dataclasses.replace(self.args, rope_theta=float(self.args.rope_local.get("rope_theta", 10000.0)),
                                        rope_scaling=self.args.rope_local)
            freqs = torch.outer(pos, rope_inv_freq(local).to(self.device))
            self.rope_local = (freqs.cos(), freqs.sin())

    def ensure_rope(self, n_positions: int) -> None:
        if n_positions > self.rope_cos.shape[0]:
            self.setup_rope(n_positions)

    def new_pool(self, n_tokens: int, page_size: int | None = None) -> KVPool:
        """A KV pool for n_tokens positions (plus the padding page) on the model's device, in its kv_cache format (or
        its dtype); laid out as its ops read it (the CUDA kernels, emulated too: slot-major)."""
        ps = page_size or PAGE_SIZE
        self.ensure_rope(min(max(n_tokens, 1), self.args.max_seq_len))
        cuda = getattr(self.ops, "name", "") == "cuda"
        return KVPool(self.args, -(-n_tokens // ps) + 1, self.device, self.dtype, ps, self.kv_cache,
                      head_major=False if cuda else None)

    def new_cache(self, max_seq_len: int | None = None) -> SeqCache:
        """One sequence's cache on a pool of its own: cache.feed(model, ids) runs the single-stream path."""
        return SeqCache(self.new_pool(max_seq_len or self.args.max_seq_len))

    def truncated(self, n_layers: int) -> Transformer:
        """The first n_layers blocks plus the final norm and head, sharing weights (a self-draft model)."""
        if not 0 < n_layers <= self.args.n_layers:
            raise ValueError(f"n_layers must be in [1, {self.args.n_layers}], got {n_layers}")
        small = copy.copy(self)
        small._modules = dict(self._modules)
        small._modules["layers"] = nn.ModuleList(list(self.layers)[:n_layers])
        small.args = dataclasses.replace(self.args, n_layers=n_layers, layer_windows=self.args.layer_windows[:n_layers])
        return small

    @torch.inference_mode()
    def forward(self, batch: Batch, kv: PagedKV) -> torch.Tensor:
        if (batch.rows is None and batch.tokens.dim() != 1) or batch.num_tokens == 0:
            raise ValueError(f"batch tokens must be a non-empty 1-D tensor, got shape {tuple(batch.tokens.shape)}")
        if len(kv.k) < len(self.layers):
            raise ValueError(f"the KV cache has {len(kv.k)} layers, the model has {len(self.layers)}")
        if batch.max_seq_len > self.rope_cos.shape[0]:
            raise ValueError(f"position {batch.max_seq_len - 1} is past the rope table of {self.rope_cos.shape[0]}")
        if self.runner is not None:
            logits = self.runner(self, batch, kv)  # None: not a graphed step, run eagerly
            if logits is not None:
                return logits
        if self.precision == "exact":
            return self.layers_forward(batch, kv)
        with exact_rows(batch.exact_rows()):  # a scored prompt's rows at float32, as the C++ forward runs them
            return self.layers_forward(batch, kv)

    def layers_forward(self, batch: Batch, kv: PagedKV) -> torch.Tensor:
        """Embedding, blocks, final norm and head; reads nothing on the host (graph-capturable with device ops)."""
        ops, eps, a = self.ops, self.args.norm_eps, self.args
        if batch.key_ends is not None and not isinstance(ops, PagedTorchOps):
            raise NotImplementedError(f"{type(ops).__name__} attends causally only; an image whose slots see each "
                                      "other (Gemma 3) runs on PagedTorchOps or the C++ step")
        rope = (self.rope_cos.index_select(0, batch.positions), self.rope_sin.index_select(0, batch.positions))
        local = rope if self.rope_local is None else tuple(r.index_select(0, batch.positions) for r in self.rope_local)
        residual = self.tok_embeddings(batch.tokens)  # (T, dim)
        if a.embed_scale != 1.0:  # Gemma: x * √dim, the factor rounded to the activations' dtype
            residual = residual * torch.tensor(a.embed_scale, dtype=residual.dtype)
        if batch.embeds is not None:  # an image's slots: its rows in place of the slot token's, not scaled (Gemma 3)
            residual = residual.index_copy(0, batch.embed_rows, batch.embeds.to(residual.device, residual.dtype))
        out: torch.Tensor | None = None
        for i, layer in enumerate(cast(list[Block], list(self.layers))):
            if out is None:
                y = ops.rms_norm(residual, layer.attention_norm.weight, eps)
            else:
                y, residual = ops.add_rms_norm(out, residual, layer.attention_norm.weight, eps)
            out = layer.attention(y, kv.k[i], kv.v[i], batch, local if layer.local_rope else rope, ops)
            if layer.attention_post_norm is not None:
                out = ops.rms_norm(out, layer.attention_post_norm.weight, eps)
            y, residual = ops.add_rms_norm(out, residual, layer.ffn_norm.weight, eps)
            out = layer.feed_forward(y, ops)
            if layer.ffn_post_norm is not None:
                out = ops.rms_norm(out, layer.ffn_post_norm.weight, eps)
        assert out is not None
        out, residual = out.index_select(0, batch.logit_rows), residual.index_select(0, batch.logit_rows)  # (R, dim)
        y, _ = ops.add_rms_norm(out, residual, self.norm.weight, eps)
        mask = exact_mask()  # the head's rows at float32 where their token rows are (Batch.exact)
        with exact_rows(None if mask is None else mask.index_select(0, batch.logit_rows.cpu())):
            logits: torch.Tensor = self.output(y).float()  # (R, vocab)
        if a.final_softcap > 0:  # Gemma 2: logits = cap * tanh(logits / cap)
            logits = torch.tanh(logits / a.final_softcap) * a.final_softcap
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
