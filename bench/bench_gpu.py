"""GPU figures in one run: greedy decode tokens/s at batch 1, 4, 16, 64 and the fraction of the bandwidth floor.

Models: the default model (SmolLM2-135M-Instruct, real weights) and randomly initialised models of Llama-3.2-1B and
Llama-3.1-8B shape, all float16. Engines on the same weights: webchat's CUDA backend (CudaOps kernels + CUDA graphs),
webchat's model on plain PyTorch ops (eager), and Hugging Face transformers (eager, its own KV cache).

Floor: a decode step must read every weight it multiplies by (all layer matrices, the final norm and the head; one
embedding row) and the whole KV cache so far; bytes/token over the device-to-device copy bandwidth measured here
(2 x bytes / time of a 1 GiB copy, read + write) is the least time a token can take.
A batch of B sequences decodes in one forward per step (webchat.model.batch on a paged pool): the weights are read once
per step, so the floor grows almost B-fold while the KV caches stay small.
Run on a CUDA machine: `.venv/bin/python -m bench.bench_gpu` (`--dry-run` checks the script on the CPU, tiny shapes).
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from bench.common import default_model, table_header, table_row

SHAPES: dict[str, dict[str, Any]] = {
    "Llama-3.2-1B shape": dict(
        hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
        head_dim=64, vocab_size=128256, rope_theta=500000.0, tie_word_embeddings=True, max_position_embeddings=131072,
        rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 8192},
    ),
    "Llama-3.1-8B shape": dict(
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
        head_dim=128, vocab_size=128256, rope_theta=500000.0, tie_word_embeddings=False, max_position_embeddings=131072,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 8192},
    ),
}  # fmt: skip
DRY_SHAPE = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=32, vocab_size=1000, rope_theta=10000.0, tie_word_embeddings=True,
                 max_position_embeddings=4096)  # fmt: skip
ENGINES = ("webchat cuda+graphs", "webchat torch ops", "transformers")


@dataclass
class Row:
    model: str
    engine: str
    batch: int
    tok_s: float
    bytes_per_token: float
    floor_tok_s: float

    @property
    def floor_fraction(self) -> float:
        return self.tok_s / self.floor_tok_s


def copy_bandwidth(device: torch.device, nbytes: int = 1 << 30) -> float:
    """Bytes/s of a device-to-device copy, counting the read and the write (best of 10)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(10):
        sync(device)
        t0 = time.perf_counter()
        dst.copy_(src)
        sync(device)
        best = min(best, time.perf_counter() - t0)
    return 2 * nbytes / best


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def bytes_per_token(model: Any, position: float) -> float:
    """Weights read by one decode step plus the KV cache read at `position` (mean position over the timed window)."""
    a = model.args
    params = {p.data_ptr(): p for p in model.parameters()}  # a tied head counts once
    weights = sum(p.numel() * p.element_size() for p in params.values())
    emb = model.tok_embeddings.weight
    if model.output.weight.data_ptr() != emb.data_ptr():
        weights -= emb.numel() * emb.element_size() - emb.shape[1] * emb.element_size()  # one row looked up
    kv = 2 * a.n_layers * a.n_kv_heads * a.head_dim * position * emb.element_size()
    return float(weights + kv)


def time_webchat(model: Any, prompt: list[int], n_new: int, batch: int = 1) -> float:
    """Aggregate decode tokens/s of `batch` sequences stepped together (one forward per step) over n_new greedy
    steps after their prompts; a warm-up pass first on the same pool."""
    from webchat.model.batch import make_batch
    from webchat.model.kv_cache import PAGE_SIZE, PageTable

    device = model.device
    pool = model.new_pool(batch * PAGE_SIZE * -(-(len(prompt) + n_new + 1) // PAGE_SIZE))

    def run(n: int) -> float:
        tables = [PageTable(pool) for _ in range(batch)]
        nxt = []
        for table in tables:  # prompt b differs from the others in its first token (no shared pages)
            table.ensure(len(prompt) + n + 1)
            p = [prompt[0] + len(nxt), *prompt[1:]]
            b = make_batch([(p, 0, table.pages, [-1])], pool.page_size, device)
            nxt.append(int(model(b, pool)[-1].argmax()))
        sync(device)
        t0 = time.perf_counter()
        for i in range(n):
            b = make_batch([([t], len(prompt) + i, tb.pages, [-1]) for t, tb in zip(nxt, tables, strict=True)],
                           pool.page_size, device)
            nxt = model(b, pool).argmax(-1).tolist()
        dt = time.perf_counter() - t0
        for table in tables:
            table.release()
        return batch * n / dt

    run(min(n_new, 8))  # compiles kernels, captures graphs
    return run(n_new)


def time_transformers(hf: Any, prompt: list[int], n_new: int) -> float:
    device = hf.device

    def run(n: int) -> float:
        with torch.inference_mode():
            out = hf(input_ids=torch.tensor([prompt], device=device), use_cache=True)
            pkv, nxt = out.past_key_values, int(out.logits[0, -1].argmax())
            sync(device)
            t0 = time.perf_counter()
            for _ in range(n):
                out = hf(input_ids=torch.tensor([[nxt]], device=device), past_key_values=pkv, use_cache=True)
                pkv, nxt = out.past_key_values, int(out.logits[0, -1].argmax())
            return n / (time.perf_counter() - t0)

    run(min(n_new, 8))
    return run(n_new)


def random_pair(cfg: dict[str, Any], device: torch.device, dtype: torch.dtype) -> tuple[Any, Any]:
    """A randomly initialised transformers Llama and webchat's Transformer sharing its weight tensors."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from webchat.model.config import ModelArgs
    from webchat.model.loader import _map_name
    from webchat.model.transformer import Transformer

    full = dict(architectures=["LlamaForCausalLM"], rms_norm_eps=1e-5, hidden_act="silu", **cfg)
    with torch.device(device):
        hf = LlamaForCausalLM._from_config(LlamaConfig(**full), dtype=dtype).eval()
    args = ModelArgs.from_dict(full, name="random")  # from our dict: transformers 5 renames rope_* keys
    with torch.device("meta"):
        ours = Transformer(args)
    state = {}
    for name, t in hf.state_dict().items():
        mapped = _map_name(name, args)
        if mapped is not None and not (mapped == "output.weight" and args.tie_embeddings):
            state[mapped] = t
    if args.tie_embeddings:
        state["output.weight"] = state["tok_embeddings.weight"]
    ours.load_state_dict(state, assign=True, strict=True)
    if args.tie_embeddings:
        ours.output.weight = ours.tok_embeddings.weight
    ours.eval()
    ours.setup_rope(4096)
    return ours, hf


def folder_pair(path: Path, device: torch.device, dtype: torch.dtype) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM

    from webchat.kernels.backend import load_model
    from webchat.kernels.cuda.graphs import disable_cuda_backend

    ours = load_model(path, device, dtype)
    disable_cuda_backend(ours)  # bench() switches engines itself
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    return ours, hf


def bench(name: str, pair: tuple[Any, Any], prompt_len: int, n_new: int, bandwidth: float,
          batches: list[int]) -> list[Row]:
    from webchat.kernels.cuda.graphs import disable_cuda_backend, enable_cuda_backend

    ours, hf = pair
    g = torch.Generator().manual_seed(0)
    prompt = [int(t) for t in torch.randint(3, ours.args.vocab_size, (prompt_len,), generator=g)]
    per_token = bytes_per_token(ours, prompt_len + n_new / 2)
    rows = []
    for engine in ENGINES:
        if engine == "webchat cuda+graphs" and not enable_cuda_backend(ours):
            print(f"[{name}] {engine}: skipped, the CUDA backend is unavailable here", file=sys.stderr)
            continue
        if engine == "webchat torch ops":
            disable_cuda_backend(ours)
        for b in batches if engine != "transformers" else [1]:
            tps = time_transformers(hf, prompt, n_new) if engine == "transformers" else \
                time_webchat(ours, prompt, n_new, b)
            # the floor is per forward: a batch of b reads the weights once and b KV caches
            step_floor = bandwidth / (per_token + (b - 1) * (per_token - weights_bytes(ours)))
            rows.append(Row(name, engine, b, tps, per_token, step_floor * b))
            print(f"[{name}] {engine} batch {b}: {tps:.1f} tok/s ({tps / (step_floor * b):.0%} of the floor)",
                  file=sys.stderr)
    return rows


def weights_bytes(model: Any) -> float:
    return bytes_per_token(model, 0)


def table(rows: list[Row], device_name: str, bandwidth: float) -> str:
    lines = [
        f"device: {device_name}; measured copy bandwidth {bandwidth / 1e9:.0f} GB/s",
        "",
        table_header("model", "engine", "batch", "decode tok/s (all sequences)", "MB read/token, batch 1",
                     "floor tok/s", "% of floor", align="llrrrrr"),
    ]
    for r in rows:
        lines.append(table_row(r.model, r.engine, r.batch, f"{r.tok_s:.1f}", f"{r.bytes_per_token / 1e6:.1f}",
                               f"{r.floor_tok_s:.0f}", f"{r.floor_fraction:.0%}"))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--models", nargs="*", default=["default", *SHAPES], help="default and/or shape names")
    ap.add_argument("--json", type=Path, default=None, help="also write the rows here")
    ap.add_argument("--batch-sweep", type=int, nargs="+", default=[1, 4, 16, 64], metavar="B",
                    help="sequences decoding together in one forward per step (default 1 4 16 64)")
    ap.add_argument("--dry-run", action="store_true", help="CPU, float32, tiny shapes: checks the script, no figures")
    ap.add_argument("--cpu", action="store_true", help="CPU, float32, real shapes: the batch sweep on this machine")
    a = ap.parse_args(argv)
    if a.dry_run:
        device, dtype = torch.device("cpu"), torch.float32
        a.prompt_len, a.new_tokens = 8, 4
    elif a.cpu:
        device, dtype = torch.device("cpu"), torch.float32
    elif not torch.cuda.is_available():
        print("bench_gpu.py needs a CUDA device (use --dry-run to check the script on the CPU)", file=sys.stderr)
        return 2
    else:
        device, dtype = torch.device("cuda"), torch.float16
    bandwidth = copy_bandwidth(device, 1 << 24 if a.dry_run else 1 << 28 if a.cpu else 1 << 30)
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (dry run)"
    rows: list[Row] = []
    for name in a.models:
        makers: dict[str, Callable[[], tuple[Any, Any]]] = {"default": lambda: folder_pair(default_dir(a.dry_run),
                                                                                         device, dtype)}  # fmt: skip
        for shape, cfg in SHAPES.items():
            makers[shape] = lambda cfg=cfg: random_pair(DRY_SHAPE if a.dry_run else cfg, device, dtype)
        if name not in makers:
            raise SystemExit(f"unknown model {name!r}; choose from {sorted(makers)}")
        label = "SmolLM2-135M-Instruct" if name == "default" else name
        rows += bench(label, makers[name](), a.prompt_len, a.new_tokens, bandwidth, a.batch_sweep)
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    print(table(rows, device_name, bandwidth))
    if a.json is not None:
        a.json.write_text(json.dumps([asdict(r) | {"floor_fraction": r.floor_fraction} for r in rows], indent=2))
    return 0


def default_dir(dry_run: bool) -> Path:
    if dry_run:
        from bench.tiny import make_tiny_model

        return make_tiny_model(Path(tempfile.mkdtemp(prefix="bench-gpu-dry-")))
    return default_model()


if __name__ == "__main__":
    sys.exit(main())
