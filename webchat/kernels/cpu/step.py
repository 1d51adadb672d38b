"""The CPU model's forward as one C++ call (kernels/cpu/csrc/qstep.cpp): the `model.runner` hook on the CPU.

A decode step of the 135M model is ~30 layers x ~15 small ops; in PyTorch their dispatch costs as much as the
matmuls. `CpuStep` hands the whole batch (tokens, positions, slot mapping, block tables, logit rows) and the paged
pool to `Step.forward`, which runs every layer with the quantized (or float32) matrices, RoPE, the paged KV write and
attention in C++ on torch's thread pool. Each row is computed on its own, so its logits do not depend on the batch.
Gemma's parts run there too: the embedding scale, the post norms, GELU-tanh, the score scale and soft cap, sliding
windows per layer and Gemma 3's local rope tables; the final soft cap is one op on the logits here. An image's slots
(webchat.model.batch.Placed) go in as given embedding rows, and Gemma 3's image attention as per-row key ends.
With float32 activations (exact), batches of more than MAX_ROWS tokens (long prefill chunks) return None and run the
PyTorch path, whose matmuls are GEMMs (webchat.model.quant.QLinear dequantizes a layer's matrix for them); with int8
activations (set_int8) the C++ forward runs every batch, each row through the same int8 kernels whatever its chunk.
"""

from __future__ import annotations

import logging
import os
from typing import cast

import torch
from torch import nn

from webchat.gguf.blocks import K_QTYPES, QTYPES
from webchat.kernels.cpu.build import QKernels, amx_tiles
from webchat.model.batch import Batch
from webchat.model.config import BEYOND_LLAMA, ModelArgs
from webchat.model.quant import QEmbedding, QLinear
from webchat.model.transformer import Block, PagedKV, Transformer

log = logging.getLogger("webchat.kernels.cpu.step")

MAX_ROWS = 64  # tokens per forward up to which the C++ step runs it
PREC = {"exact": 0, "int8": 1, "int8x2": 2}  # qstep.h's Prec
KV_DTYPES = (torch.float32, torch.float16, torch.uint8)  # the pools it reads: f32, f16, q8_0 (webchat.model.kv_format)
# a prompt's rows at each precision (docs/quant.md, "Precisions"): one kernel whatever the chunk (exact rows for a
# prompt scored come from the batch's exact flags); int8x2's are exact where the exact GEMM has AMX tiles
# (qgemm_amx.cpp: there float32-accurate rows cost less than int8x2's), int8x2 elsewhere
PROMPT_PRECISION = {"exact": "exact", "int8": "int8", "int8x2": "int8x2"}
PROMPT_PRECISION_AMX = {**PROMPT_PRECISION, "int8x2": "exact"}
F32 = 0  # ggml's type number for float32 rows
NONE = torch.empty(0)


def _matrix(m: nn.Module) -> tuple[torch.Tensor, int] | None:
    """(weight, ggml type) of a QLinear/QEmbedding or a float32 Linear/Embedding; None for anything else."""
    if isinstance(m, QLinear | QEmbedding):  # the 32-value formats (qmatmul.cpp), the K-quants (qkquant.cpp)
        known = {**QTYPES, **K_QTYPES}
        return (m.weight, known[m.qtype][0]) if m.qtype in known else None
    if isinstance(m, nn.Linear | nn.Embedding) and m.weight.dtype == torch.float32 and m.weight.is_contiguous():
        return m.weight.detach(), F32
    return None


def _bias(m: nn.Module) -> torch.Tensor:
    bias = getattr(m, "bias", None)
    return torch.empty(0) if bias is None else bias.detach().float().contiguous()


class CpuStep:
    """model.runner(model, batch, kv) -> logits (R, vocab), or None where the PyTorch path runs the batch."""

    def __init__(self, model: Transformer, kernels: QKernels) -> None:
        a = model.args
        mats: list[torch.Tensor] = []
        qtypes: list[int] = []
        norms: list[torch.Tensor] = []
        biases: list[torch.Tensor] = []
        qk_norms: list[torch.Tensor] = []  # Qwen3's and Gemma 3's per-head q and k norms, before rope
        post_norms: list[torch.Tensor] = []  # Gemma's norms of the attention's and the MLP's outputs
        for layer in cast(list[Block], list(model.layers)):
            att, ff = layer.attention, layer.feed_forward
            norms += [layer.attention_norm.weight.detach(), layer.ffn_norm.weight.detach()]
            if att.q_norm is not None and att.k_norm is not None:
                qk_norms += [att.q_norm.weight.detach(), att.k_norm.weight.detach()]
            if layer.attention_post_norm is not None and layer.ffn_post_norm is not None:
                post_norms += [layer.attention_post_norm.weight.detach(), layer.ffn_post_norm.weight.detach()]
            for m in (att.wq, att.wk, att.wv, att.wo, ff.w1, ff.w3, ff.w2):
                wt = _matrix(m)
                if wt is None:
                    raise TypeError(f"{m!r} has no C++ path")
                mats.append(wt[0])
                qtypes.append(wt[1])
            biases += [_bias(att.wq), _bias(att.wk), _bias(att.wv)]
        emb, head = _matrix(model.tok_embeddings), _matrix(model.output)
        if emb is None or head is None:
            raise TypeError("the embedding and head must be quantized or float32 for the C++ path")
        layers = cast(list[Block], list(model.layers))
        scalars = [a.embed_scale, a.attn_scale, a.attn_softcap, 1.0 if a.act == "gelu_tanh" else 0.0]
        self.step = kernels.Step([a.dim, a.n_heads, a.n_kv_heads, a.head_dim, a.ffn_dim], a.norm_eps, emb[0], emb[1],
                                 head[0], head[1], model.norm.weight.detach(), norms, mats, qtypes, biases, qk_norms,
                                 post_norms, list(a.layer_windows), [int(b.local_rope) for b in layers], scalars)
        self.final_softcap = a.final_softcap
        self.embedding = model.tok_embeddings
        self.layers = list(model.layers)
        self.kernels = kernels
        self.prompt_precision = "exact"  # what set_precision chose for a prompt's rows
        self.calls = 0
        self.int8 = False  # a precision other than exact: every batch runs here, whatever its size

    def set_int8(self, on: bool, pack: bool = True) -> None:
        """The quantized matrices' inputs at 8 bits (int8 activations) or float32; pack: the matrices that have a
        packed form read it (webchat.model.precision packs their bytes first)."""
        self.set_precision("int8" if on else "exact", pack)

    def set_precision(self, precision: str, pack: bool = True) -> None:
        """Decode, verify and recomputed rows at `precision` (webchat.model.weights.PRECISIONS), a prompt's rows at
        PROMPT_PRECISION's for it (PROMPT_PRECISION_AMX's where the exact GEMM has AMX tiles); pack: as set_int8."""
        self.prompt_precision = (PROMPT_PRECISION_AMX if amx_tiles(self.kernels) else PROMPT_PRECISION)[precision]
        self.step.set_precision(PREC[precision], PREC[self.prompt_precision], pack)
        self.int8 = precision != "exact"

    def __call__(self, model: Transformer, batch: Batch, kv: PagedKV) -> torch.Tensor | None:
        n = len(model.layers)
        if ((batch.num_tokens > MAX_ROWS and not self.int8) or model.tok_embeddings is not self.embedding
                or n > len(self.layers) or model.layers[n - 1] is not self.layers[n - 1]
                or kv.k[0].dtype not in KV_DTYPES):
            return None  # a long prefill chunk (exact), or another model sharing this hook
        self.calls += 1
        local = model.rope_local or (NONE, NONE)
        rows = batch.rows
        logits: torch.Tensor
        exact = batch.exact  # a scored prompt's rows at float32 (Batch.exact)
        if rows is not None:  # make_batch's lists as they are: no tensor made for them
            logits = self.step.forward_rows(
                rows.tokens, rows.positions, rows.slot_mapping, rows.query_start, rows.block_tables, rows.width,
                rows.logit_rows, rows.prompt_ends or [], kv.k, kv.v, model.rope_cos, model.rope_sin, *local, n,
                rows.embed_rows or [], NONE if batch.embeds is None else batch.embeds.contiguous(),
                rows.key_ends or [], exact or [])
        elif batch.embeds is not None:
            return None  # an image's rows come with host rows only (make_batch)
        else:
            logits = self.step.forward(
                batch.tokens, batch.positions, batch.slot_mapping, batch.query_start, batch.block_tables,
                batch.logit_rows, NONE if batch.prompt_ends is None else batch.prompt_ends, kv.k, kv.v,
                model.rope_cos, model.rope_sin, *local, n, torch.tensor(exact or [], dtype=torch.bool))
        if self.final_softcap > 0:  # Gemma 2: logits = cap * tanh(logits / cap), as the PyTorch path computes it
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits


def cpu_step_declines(args: ModelArgs) -> str | None:
    """Why the C++ forward cannot run this architecture, or None where it can."""
    extra = [x for x in args.beyond_llama if x not in BEYOND_LLAMA]  # it runs each of them
    return f"{args.arch or 'this model'} needs {', '.join(extra)}" if extra else None


def enable_cpu_step(model: Transformer, kernels: QKernels | None) -> bool:
    """Install CpuStep as the model's runner where it can run (CPU, float32 activations, kernels built)."""
    if os.environ.get("WEBCHAT_CPU_STEP", "1") == "0":
        log.info("WEBCHAT_CPU_STEP=0: the model runs on PyTorch ops")
        return False
    if kernels is None or model.device.type != "cpu" or model.dtype != torch.float32:
        return False
    reason = cpu_step_declines(model.args)
    if reason is not None:
        log.info("the C++ forward declines, PyTorch ops run the model: %s", reason)
        return False
    try:
        model.runner = CpuStep(model, kernels)
    except TypeError as e:
        log.info("the C++ forward does not cover this model, PyTorch ops run it: %s", e)
        return False
    return True
