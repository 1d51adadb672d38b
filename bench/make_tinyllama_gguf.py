"""Llama-shaped GGUFs with random weights, for bench.bench_served: how each server's cost grows with the model.

Two shapes (`--shape`):
  tinyllama   TinyLlama-1.1B's: 22 layers, dim 2048, FFN 5632, 32 heads, 4 KV heads, head dim 64, rope base 10000, an
              untied head; the default model's vocabulary (SmolLM2's 49,152 tokens), so the embedding and head are 1.5x
              TinyLlama's (1.13B parameters in all)
  llama32-3b  Llama-3.2-3B's: 28 layers, dim 3072, FFN 8192, 24 heads, 8 KV heads, head dim 128, rope base 500000,
              tied embeddings, 128,256 tokens (3.21B parameters): the default model's byte-level BPE vocabulary padded
              with normal tokens `Ġreserved<i>` that no merge reaches, so both servers tokenize every text as the
              default model does (and agree on its ids) while the embedding and head have Llama 3's 128k rows
  llama31-8b  Llama-3.1-8B's: 32 layers, dim 4096, FFN 14336, 32 heads, 8 KV heads, head dim 128, rope base 500000,
              an untied head, the same padded 128,256 tokens (8.03B parameters)
The tokenizer, chat template and special ids are copied from the default model's GGUF, so both servers read a
tokenizer they know.

Weight types (`--type`):
  q4_1  Q4_1 matrices, a Q8_0 embedding, a Q4_1 head (quantized here with `gguf.quants`; the first bench file)
  f16   every matrix float16: the source that llama.cpp's `llama-quantize` turns into the files users download
        (bench/make_bench_files.sh)
  f32   every matrix float32
Norms are float32 ones. Deterministic (seed 0, the tensors drawn in file order), written tensor by tensor, so memory
stays near the largest tensor (the 8B's float16 embedding, 1.1 GB) while the file is 2.3 GB (tinyllama f16), 6.4 GB
(llama32-3b f16) or 16.1 GB (llama31-8b f16).

    .venv/bin/python -m bench.make_tinyllama_gguf [--shape tinyllama] [--type q4_1] [--out PATH]
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from bench.common import default_gguf

CHUNK = 1 << 24  # values drawn per call while filling a float tensor (64 MB of float32)
STD = 0.02
PAD_TOKEN = "Ġreserved{}"  # byte-level text " reserved<i>": a normal token no merge produces


@dataclass(frozen=True)
class Shape:
    name: str
    layers: int
    dim: int
    ffn: int
    heads: int
    kv_heads: int
    rope_theta: float
    ctx: int
    vocab: int | None  # None: the source vocabulary's size
    tied: bool

    @property
    def head_dim(self) -> int:
        return self.dim // self.heads


SHAPES = {
    "tinyllama": Shape("TinyLlama-1.1B", 22, 2048, 5632, 32, 4, 10000.0, 2048, None, False),
    "llama32-3b": Shape("Llama-3.2-3B", 28, 3072, 8192, 24, 8, 500000.0, 131072, 128256, True),
    "llama31-8b": Shape("Llama-3.1-8B", 32, 4096, 14336, 32, 8, 500000.0, 131072, 128256, False),
}


def default_out(shape: str, wtype: str) -> Path:
    home = Path(os.environ.get("WEBCHAT_HOME", Path.home() / ".cache" / "webchat"))
    return home / f"{shape}-shape-{wtype}.gguf"


def tensor_specs(s: Shape, vocab: int) -> list[tuple[str, tuple[int, ...], str]]:
    """(name, (rows, cols), role) in file order; role is "norm", "embd", "head" or "matrix"."""
    kv = s.head_dim * s.kv_heads
    specs: list[tuple[str, tuple[int, ...], str]] = [("token_embd.weight", (vocab, s.dim), "embd")]
    for i in range(s.layers):
        specs += [(f"blk.{i}.attn_norm.weight", (s.dim,), "norm"),
                  (f"blk.{i}.attn_q.weight", (s.dim, s.dim), "matrix"),
                  (f"blk.{i}.attn_k.weight", (kv, s.dim), "matrix"),
                  (f"blk.{i}.attn_v.weight", (kv, s.dim), "matrix"),
                  (f"blk.{i}.attn_output.weight", (s.dim, s.dim), "matrix"),
                  (f"blk.{i}.ffn_norm.weight", (s.dim,), "norm"),
                  (f"blk.{i}.ffn_gate.weight", (s.ffn, s.dim), "matrix"),
                  (f"blk.{i}.ffn_up.weight", (s.ffn, s.dim), "matrix"),
                  (f"blk.{i}.ffn_down.weight", (s.dim, s.ffn), "matrix")]
    specs.append(("output_norm.weight", (s.dim,), "norm"))
    if not s.tied:
        specs.append(("output.weight", (vocab, s.dim), "head"))
    return specs


def storage(role: str, wtype: str) -> Any:
    """The GGMLQuantizationType a tensor of `role` is written in for `--type wtype`."""
    from gguf import GGMLQuantizationType as Q

    if role == "norm" or wtype == "f32":
        return Q.F32
    if wtype == "f16":
        return Q.F16
    return Q.Q8_0 if role == "embd" else Q.Q4_1


def draw(rng: np.random.Generator, shape: tuple[int, ...], qtype: Any) -> np.ndarray:
    """N(0, STD^2) values in `qtype`, drawn row block by row block (the same values as one draw of the whole)."""
    import gguf
    from gguf import GGMLQuantizationType as Q

    if len(shape) == 1:
        return np.ones(shape, dtype=np.float32)
    rows, cols = shape
    dtype = np.float16 if qtype == Q.F16 else np.float32
    out = np.empty(shape, dtype=dtype)
    step = max(1, CHUNK // cols)
    for a in range(0, rows, step):
        b = min(rows, a + step)
        out[a:b] = rng.standard_normal((b - a, cols), dtype=np.float32) * np.float32(STD)
    if qtype in (Q.F16, Q.F32):
        return out
    return gguf.quants.quantize(out, qtype)


def copy_tokenizer(writer: Any, source: Any, vocab: int) -> None:
    """The source GGUF's tokenizer.* fields; the token list (and types) padded to `vocab` with PAD_TOKEN normals."""
    import gguf

    for key, field in source.fields.items():
        if not key.startswith("tokenizer."):
            continue
        value = field.contents()
        if key == "tokenizer.ggml.tokens":
            value = value + [PAD_TOKEN.format(i) for i in range(len(value), vocab)]
        elif key == "tokenizer.ggml.token_type":
            value = value + [int(gguf.TokenType.NORMAL)] * (vocab - len(value))
        elif key == "tokenizer.ggml.scores":
            value = value + [0.0] * (vocab - len(value))
        sub = field.types[1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, value, field.types[0], sub)


def write(out: Path, s: Shape, wtype: str, source_path: Path) -> None:
    import gguf

    source = gguf.GGUFReader(str(source_path))
    vocab = s.vocab or len(source.fields["tokenizer.ggml.tokens"].data)
    part = out.with_suffix(".gguf.part")
    writer = gguf.GGUFWriter(str(part), "llama")
    writer.add_name(f"{s.name}-shaped random weights (webchat bench)")
    writer.add_block_count(s.layers)
    writer.add_context_length(s.ctx)
    writer.add_embedding_length(s.dim)
    writer.add_feed_forward_length(s.ffn)
    writer.add_head_count(s.heads)
    writer.add_head_count_kv(s.kv_heads)
    writer.add_rope_freq_base(s.rope_theta)
    writer.add_rope_dimension_count(s.head_dim)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(vocab)
    file_type = {"q4_1": gguf.LlamaFileType.MOSTLY_Q4_1, "f16": gguf.LlamaFileType.MOSTLY_F16,
                 "f32": gguf.LlamaFileType.ALL_F32}[wtype]
    writer.add_file_type(file_type)
    copy_tokenizer(writer, source, vocab)
    specs = tensor_specs(s, vocab)
    for name, shape, role in specs:
        qtype = storage(role, wtype)
        nbytes = int(np.prod(gguf.quants.quant_shape_to_byte_shape(shape, qtype)))
        if qtype == gguf.GGMLQuantizationType.F16:
            writer.add_tensor_info(name, shape, np.dtype(np.float16), nbytes)
        elif qtype == gguf.GGMLQuantizationType.F32:
            writer.add_tensor_info(name, shape, np.dtype(np.float32), nbytes)
        else:
            writer.add_tensor_info(name, shape, np.dtype(np.float32), nbytes, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    rng = np.random.default_rng(0)
    tty = sys.stdout.isatty()
    for n, (_, shape, role) in enumerate(specs):
        if tty:
            print(f"\rtensor {n + 1}/{len(specs)}", end="", flush=True)
        writer.write_tensor_data(draw(rng, shape, storage(role, wtype)))
    if tty:
        print()
    writer.close()
    part.replace(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=list(SHAPES), default="tinyllama")
    parser.add_argument("--type", choices=["q4_1", "f16", "f32"], default="q4_1", dest="wtype")
    parser.add_argument("--out", type=Path, default=None, help="default: $WEBCHAT_HOME/<shape>-shape-<type>.gguf")
    parser.add_argument("--source", type=Path, default=None, help="GGUF to copy the tokenizer from (default model's)")
    args = parser.parse_args()
    out = args.out or default_out(args.shape, args.wtype)
    out.parent.mkdir(parents=True, exist_ok=True)
    write(out, SHAPES[args.shape], args.wtype, args.source or default_gguf())
    print(out)


if __name__ == "__main__":
    main()
