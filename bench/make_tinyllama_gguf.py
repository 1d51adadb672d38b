"""A ~1.1B-parameter Llama-shaped GGUF with random weights, for bench/bench_served.py: how each server's cost grows
with the model.

TinyLlama-1.1B's shapes (22 layers, dim 2048, FFN 5632, 32 heads, 4 KV heads, head dim 64, rope base 10000), Q4_1
matrices, a Q8_0 embedding and a Q4_1 output head (untied), float32 norms. The vocabulary and tokenizer are the
default model's (SmolLM2's 49,152 tokens, copied from its GGUF) so both servers read a tokenizer they know; that makes
the embedding and head 1.5x TinyLlama's (1.13B parameters in all). Written with `gguf`'s writer and quantized with
`gguf.quants`; deterministic (seed 0), one file for both servers.

    .venv/bin/python bench/make_tinyllama_gguf.py [--out PATH]     # ~0.7 GB, a few minutes
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import numpy as np

LAYERS, DIM, FFN, HEADS, KV_HEADS, CTX = 22, 2048, 5632, 32, 4, 2048


def default_out() -> Path:
    home = Path(os.environ.get("WEBCHAT_HOME", Path.home() / ".cache" / "webchat"))
    return home / "tinyllama-shape-q4_1.gguf"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=default_out())
    parser.add_argument("--source", type=Path, default=None, help="GGUF to copy the tokenizer from (default model's)")
    args = parser.parse_args()
    import gguf
    from gguf import GGMLQuantizationType as Q

    from webchat.pull import ensure_default_gguf

    source = gguf.GGUFReader(str(args.source or ensure_default_gguf()))
    vocab = len(source.fields["tokenizer.ggml.tokens"].data)
    rng = np.random.default_rng(0)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    part = args.out.with_suffix(".gguf.part")
    writer = gguf.GGUFWriter(str(part), "llama")
    writer.add_name("TinyLlama-shaped random weights (webchat bench)")
    writer.add_block_count(LAYERS)
    writer.add_context_length(CTX)
    writer.add_embedding_length(DIM)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_freq_base(10000.0)
    writer.add_rope_dimension_count(DIM // HEADS)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(vocab)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_1)
    for key, field in source.fields.items():
        if not key.startswith("tokenizer."):
            continue
        value = field.contents()
        sub = field.types[1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, value, field.types[0], sub)

    def tensor(name: str, shape: tuple[int, ...], qtype: Q | None, std: float = 0.02) -> None:
        if qtype is None:
            writer.add_tensor(name, np.ones(shape, dtype=np.float32))
            return
        data = (rng.standard_normal(shape, dtype=np.float32) * std).astype(np.float32)
        writer.add_tensor(name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)

    kv = DIM // HEADS * KV_HEADS
    tensor("token_embd.weight", (vocab, DIM), Q.Q8_0)
    for i in range(LAYERS):
        print(f"\rlayer {i + 1}/{LAYERS}", end="", flush=True)
        tensor(f"blk.{i}.attn_norm.weight", (DIM,), None)
        tensor(f"blk.{i}.attn_q.weight", (DIM, DIM), Q.Q4_1)
        tensor(f"blk.{i}.attn_k.weight", (kv, DIM), Q.Q4_1)
        tensor(f"blk.{i}.attn_v.weight", (kv, DIM), Q.Q4_1)
        tensor(f"blk.{i}.attn_output.weight", (DIM, DIM), Q.Q4_1)
        tensor(f"blk.{i}.ffn_norm.weight", (DIM,), None)
        tensor(f"blk.{i}.ffn_gate.weight", (FFN, DIM), Q.Q4_1)
        tensor(f"blk.{i}.ffn_up.weight", (FFN, DIM), Q.Q4_1)
        tensor(f"blk.{i}.ffn_down.weight", (DIM, FFN), Q.Q4_1)
    tensor("output_norm.weight", (DIM,), None)
    tensor("output.weight", (vocab, DIM), Q.Q4_1)
    print()
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file(progress=True)
    writer.close()
    part.replace(args.out)
    print(args.out)


if __name__ == "__main__":
    main()
