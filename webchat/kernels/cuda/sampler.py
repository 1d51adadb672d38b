"""CudaSampler: webchat.engine.sampling.Sampler's semantics on the GPU, with one small copy to the host per token.

Token bias and penalties run in kernels/cuda/sampling.cu; temperature, top-k, top-p, min-p, typical-p, the inverse-CDF
draw and the description (probability, rank, top alternatives) are sync-free torch ops on the device; everything the
host needs is packed into one float64 vector and copied once. The uniform comes from the same seeded CPU generator as
Sampler's (one per sampled token), so a seed gives the same draws on either path.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from webchat.engine import constraint as cst
from webchat.engine.sampling import Choice, Sampler, draw
from webchat.engine.settings import MAX_TOP_ALTS, SamplingSettings
from webchat.kernels.cuda.launch import ELEMENTWISE_THREADS, KernelInputError, Launch, Launcher, blocks, check, i32, ptr


def plan_count(ids: torch.Tensor, counts: torch.Tensor) -> Launch:
    check("ids", ids, (None,), torch.int32)
    check("counts", counts, (None,), torch.float32)
    return Launch("sampling", "sample_count_f32", (blocks(ids.numel(), ELEMENTWISE_THREADS), 1, 1),
                  (ELEMENTWISE_THREADS, 1, 1))  # fmt: skip


def plan_adjust(raw: torch.Tensor, bias: torch.Tensor | None, counts: torch.Tensor | None) -> Launch:
    check("logits", raw, (None,), torch.float32)
    n = raw.shape[0]
    if bias is not None:
        check("bias", bias, (n,), torch.float32)
    if counts is not None:
        check("counts", counts, (n,), torch.float32)
    return Launch("sampling", "sample_adjust_f32", (blocks(n, ELEMENTWISE_THREADS), 1, 1), (ELEMENTWISE_THREADS, 1, 1))


class CudaSampler(Sampler):
    """Sampler for logits on a CUDA device; the same settings, seed handling and Choice as Sampler.

    launcher: CudaOps' kernel launcher for kernels/cuda/sampling.cu; None computes bias and penalties with Sampler's
    torch code instead (on the CPU: how the device-independent parts are tested without a GPU).
    """

    def __init__(self, settings: SamplingSettings, vocab_size: int, launcher: Launcher | None = None) -> None:
        super().__init__(settings, vocab_size)
        self._launch = launcher
        self._bias_dev: torch.Tensor | None = None

    def sample(
        self, logits: torch.Tensor, history: list[int], top_alts: int = 0, want_probs: bool = False,
        want_logits: bool = False, mask: torch.Tensor | None = None,
    ) -> Choice:  # fmt: skip
        raw = logits.float().reshape(-1)  # (vocab,)
        if raw.shape[0] != self.vocab_size:
            raise KernelInputError(f"logits must hold {self.vocab_size} values, got shape {tuple(logits.shape)}")
        x = self._adjust_device(raw, history) if self._launch is not None else self._adjust(raw, history)
        if mask is not None:  # the constraint's bits, unpacked on the host and uploaded (one (vocab,) bool row)
            x = x.clone() if x is raw else x
            x.masked_fill_(~cst.allowed(mask, self.vocab_size).to(x.device, non_blocking=True), float("-inf"))
        s, describe = self.settings, want_probs or top_alts > 0
        if s.greedy:
            token, sampled = torch.argmax(x), torch.ones((), dtype=torch.float64, device=x.device)
        else:
            u = float(torch.rand((), generator=self.rng, dtype=torch.float64))  # CPU generator, as Sampler
            token, sampled = draw(x, s, u)
        parts = [token.double().reshape(1), sampled.reshape(1)]
        k = min(top_alts, MAX_TOP_ALTS)
        if describe:
            logp = torch.log_softmax(raw, dim=-1)
            chosen = logp.index_select(0, token.reshape(1))[0]
            vals, idx = torch.topk(logp, k) if k > 0 else (logp[:0], torch.zeros(0, dtype=torch.long, device=x.device))
            parts += [chosen.exp().double().reshape(1), ((logp > chosen).sum() + 1).double().reshape(1),
                      idx.double(), vals.exp().double()]  # fmt: skip
        host = torch.cat(parts).tolist()  # the one copy to the host
        choice = Choice(token=int(host[0]), sampled_prob=host[1] if describe else None)
        if describe:
            choice.prob, choice.rank = host[2], int(host[3])
            choice.top = [(int(i), p) for i, p in zip(host[4 : 4 + k], host[4 + k :], strict=True)]
            if mask is not None:
                choice.forbidden = [t for t, _ in choice.top if not cst.allows(mask, t)]
        if want_logits:
            choice.logits = raw.detach().cpu().clone()
        return choice

    def _adjust_device(self, raw: torch.Tensor, history: list[int]) -> torch.Tensor:
        """Bias and penalties through kernels/cuda/sampling.cu; returns raw itself when there is nothing to adjust."""
        s, launch = self.settings, self._launch
        assert launch is not None
        if self._bias is not None and self._bias_dev is None:
            self._bias_dev = self._bias.to(raw.device)
        penalise = s.penalised and bool(history)
        if self._bias_dev is None and not penalise:
            return raw
        counts = None
        if penalise:
            window = history[-s.repetition_range :] if s.repetition_range else history
            ids = torch.tensor(window, dtype=torch.int32)  # (n,) uploaded from pinned memory, no host wait
            if raw.is_cuda:
                ids = ids.pin_memory().to(raw.device, non_blocking=True)
            counts = torch.zeros_like(raw)
            launch(plan_count(ids, counts), (ptr(ids), i32(ids.numel()), ptr(counts), i32(self.vocab_size)))
        x = torch.empty_like(raw)
        args: Sequence[np.generic] = (ptr(raw), ptr(self._bias_dev), ptr(counts), ptr(x), i32(self.vocab_size),
                                      np.float32(s.repetition_penalty), np.float32(s.frequency_penalty),
                                      np.float32(s.presence_penalty))  # fmt: skip
        launch(plan_adjust(raw, self._bias_dev, counts), args)
        return x


def cuda_sampler(settings: SamplingSettings, vocab_size: int, device: torch.device | str) -> Sampler:
    """CudaSampler (kernels on `device`) where the logits live on a CUDA device and CuPy works; else Sampler. The CUDA
    backend installs it as the model's sampler_factory (webchat.kernels.cuda.graphs.enable_cuda_backend)."""
    device = torch.device(device)
    if device.type != "cuda":
        return Sampler(settings, vocab_size)
    from webchat.kernels.cuda.loader import KernelUnavailable
    from webchat.kernels.cuda.ops import cupy_launcher

    try:
        launcher = cupy_launcher(device)
    except KernelUnavailable:
        return Sampler(settings, vocab_size)
    return CudaSampler(settings, vocab_size, launcher)
