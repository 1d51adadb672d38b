"""The vision encoder in plain PyTorch, float32: SigLIP over each tile, then the projector (idefics3's pixel shuffle and
linear layer, gemma3's pooling, norm and projection). The readable reference the C++ forward is tested against.

    x = conv(pixels, patch, stride p) + pos                          (N, P, D)
    per layer: x += out(attn(ln1(x))); x += down(gelu_tanh(up(ln2(x))))   attention over a tile's P patches, no mask
    x = post_ln(x)
    idefics3: y = shuffle_s(x) @ fc^T      (N, P / s^2, D s^2) -> (N, P / s^2, T)
    gemma3:   y = rms(avgpool_s(x)) * w @ W  (N, (side / s)^2, D) -> (N, 256, T); w already holds Gemma's 1 + weight
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from webchat.vision.projector_file import ProjectorConfig


class VisionOps:
    """The encoder's ops in PyTorch (the ops-table style of webchat.model.ops)."""

    @staticmethod
    def layer_norm(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, eps: float) -> torch.Tensor:
        # y = (x - mean) / sqrt(var + eps) * w + b
        return F.layer_norm(x, (x.shape[-1],), w, b, eps)

    @staticmethod
    def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
        # y = x/2 (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))
        return F.gelu(x, approximate="tanh")

    @staticmethod
    def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # q, k, v (N, H, P, hd): softmax(q k^T / sqrt(hd)) v, every patch sees every patch of its tile
        return F.scaled_dot_product_attention(q, k, v)

    @staticmethod
    def pixel_shuffle(x: torch.Tensor, s: int) -> torch.Tensor:
        # (N, side*side, D) -> (N, (side/s)^2, D s^2): token (i, j) holds patches (s i + a, s j + b), a-major, as
        # transformers' Idefics3Connector.pixel_shuffle orders them
        n, p, d = x.shape
        side = int(p**0.5)
        x = x.view(n, side, side // s, d * s).permute(0, 2, 1, 3)
        x = x.reshape(n, side // s, side // s, d * s * s).permute(0, 2, 1, 3)
        return x.reshape(n, p // (s * s), d * s * s)

    @staticmethod
    def avg_pool(x: torch.Tensor, s: int) -> torch.Tensor:
        # (N, side*side, D) -> (N, (side/s)^2, D): the mean of each s x s block of patches
        n, p, d = x.shape
        side = int(p**0.5)
        grid = x.transpose(1, 2).reshape(n, d, side, side)
        return F.avg_pool2d(grid, s, s).flatten(2).transpose(1, 2)

    @staticmethod
    def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
        # y = x / sqrt(mean(x^2) + eps) * w
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def encode_tiles(w: dict[str, torch.Tensor], c: ProjectorConfig, pixels: torch.Tensor,
                 ops: type[VisionOps] = VisionOps) -> torch.Tensor:
    """pixels (N, 3, S, S) float32 -> (N * tokens_per_tile, T) float32."""
    if pixels.shape[1:] != (3, c.image_size, c.image_size):
        raise ValueError(f"tiles must be (N, 3, {c.image_size}, {c.image_size}); got {tuple(pixels.shape)}")
    x = tower(w, c, pixels, ops)
    if c.kind == "idefics3":
        y = ops.pixel_shuffle(x, c.scale_factor) @ w["proj.weight"].t()
    else:
        y = ops.rms_norm(ops.avg_pool(x, c.scale_factor), w["proj.norm"], c.eps) @ w["proj.weight"]
    return y.reshape(-1, c.text_dim)


def tower(w: dict[str, torch.Tensor], c: ProjectorConfig, pixels: torch.Tensor,
          ops: type[VisionOps] = VisionOps) -> torch.Tensor:
    """SigLIP's hidden states after post_ln: (N, P, D)."""
    n = pixels.shape[0]
    x = F.conv2d(pixels, w["patch.weight"], w["patch.bias"], stride=c.patch_size)  # (N, D, side, side)
    x = x.flatten(2).transpose(1, 2) + w["pos"]  # (N, P, D)
    for i in range(c.layers):
        h = ops.layer_norm(x, w[f"{i}.ln1.weight"], w[f"{i}.ln1.bias"], c.eps)
        q, k, v = (F.linear(h, w[f"{i}.{m}.weight"], w[f"{i}.{m}.bias"]).view(n, -1, c.heads, c.head_dim)
                   .transpose(1, 2) for m in ("q", "k", "v"))  # (N, H, P, hd)
        a = ops.attention(q, k, v).transpose(1, 2).reshape(n, -1, c.width)
        x = x + F.linear(a, w[f"{i}.out.weight"], w[f"{i}.out.bias"])
        h = ops.layer_norm(x, w[f"{i}.ln2.weight"], w[f"{i}.ln2.bias"], c.eps)
        x = x + F.linear(ops.gelu_tanh(F.linear(h, w[f"{i}.up.weight"], w[f"{i}.up.bias"])), w[f"{i}.down.weight"],
                         w[f"{i}.down.bias"])
    return ops.layer_norm(x, w["post_ln.weight"], w["post_ln.bias"], c.eps)
