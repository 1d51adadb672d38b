"""GPU batch sweep: aggregate greedy decode tokens/s of B sequences stepped together (B = 1, 4, 16, 64) on a paged KV
cache, through webchat.cuda_backend's batched step.

Engines on the same weights: CudaOps kernels replayed from the CUDA graph of B's bucket (GraphRunner), the same
kernels eager, and webchat's paged PyTorch ops (PagedTorchOps) eager. Each sequence has its own random prompt
(--prompt-len tokens, prefilled in one eager ragged batch), then --new-tokens decode steps of one row per sequence;
the steps' batch metadata is built before the clock starts and the next tokens stay on the device (argmax), so the
figure is the forward's. Models as in bench_gpu.py (default, Llama-3.2-1B and Llama-3.1-8B shapes; float16).
Run on a CUDA machine: `.venv/bin/python bench/bench_gpu_batch.py` (`--dry-run`: CPU, tiny shapes, torch ops only).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_gpu import DRY_SHAPE, SHAPES, default_dir, random_pair, sync  # noqa: E402

from webchat.batch import Batch, make_batch  # noqa: E402

BATCHES = (1, 4, 16, 64)
ENGINES = ("cuda+graphs", "cuda eager", "torch ops")
PAGE_SIZE = 16


@dataclass
class Row:
    model: str
    engine: str
    batch: int
    tok_s: float  # all sequences together

    @property
    def per_seq(self) -> float:
        return self.tok_s / self.batch


@dataclass
class Pool:
    k: list[torch.Tensor]
    v: list[torch.Tensor]


def plan(model: Any, b: int, prompt_len: int, n_new: int) -> tuple[Pool, Batch, list[Batch]]:
    """A pool, the prefill batch of b random prompts, and the n_new decode batches (tokens filled in as we go)."""
    pages_per_seq = -(-(prompt_len + n_new) // PAGE_SIZE)
    a = model.args
    shape = (1 + b * pages_per_seq, PAGE_SIZE, a.n_kv_heads, a.head_dim)
    pool = Pool(*([torch.zeros(shape, dtype=model.dtype, device=model.device) for _ in model.layers] for _ in "kv"))
    perm = (torch.randperm(b * pages_per_seq, generator=torch.Generator().manual_seed(b)) + 1).tolist()
    tables = [perm[i * pages_per_seq : (i + 1) * pages_per_seq] for i in range(b)]
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, a.vocab_size, (prompt_len,), generator=g).tolist() for _ in range(b)]
    prefill = make_batch([(p, 0, t, [-1]) for p, t in zip(prompts, tables, strict=True)], PAGE_SIZE, model.device)
    steps = [make_batch([([0], prompt_len + i, t, [-1]) for t in tables], PAGE_SIZE, model.device)
             for i in range(n_new)]  # fmt: skip
    return pool, prefill, steps


def time_engine(model: Any, b: int, prompt_len: int, n_new: int) -> float:
    """Aggregate decode tokens/s of b sequences; a warm-up pass first (compiles, captures the bucket's graph)."""
    from webchat.cuda_backend import batch_step

    pool, prefill, steps = plan(model, b, prompt_len, n_new)

    def forward(batch: Batch) -> torch.Tensor:
        got = model.runner(model, batch, pool) if model.runner is not None else None
        return got if got is not None else batch_step(model, batch, pool)

    def run(n: int) -> float:
        nxt = batch_step(model, prefill, pool).argmax(-1)  # (b,)
        sync(model.device)
        t0 = time.perf_counter()
        for batch in steps[:n]:
            batch.tokens.copy_(nxt)
            nxt = forward(batch).argmax(-1)
        sync(model.device)
        return b * n / (time.perf_counter() - t0)

    run(min(n_new, 4))
    return run(n_new)


def sweep(name: str, model: Any, batches: list[int], prompt_len: int, n_new: int) -> list[Row]:
    from webchat.cuda_backend import disable_cuda_backend, enable_cuda_backend

    rows = []
    for engine in ENGINES:
        if engine == "torch ops":
            disable_cuda_backend(model)
        elif not enable_cuda_backend(model, graphs=engine == "cuda+graphs"):
            print(f"[{name}] {engine}: skipped, the CUDA backend is unavailable here", file=sys.stderr)
            continue
        for b in batches:
            rows.append(Row(name, engine, b, time_engine(model, b, prompt_len, n_new)))
            print(f"[{name}] {engine} B={b}: {rows[-1].tok_s:.1f} tok/s", file=sys.stderr)
    return rows


def table(rows: list[Row], device_name: str) -> str:
    lines = [f"device: {device_name}", "", "| model | engine | batch | aggregate tok/s | per sequence tok/s |",
             "|---|---|---:|---:|---:|"]  # fmt: skip
    lines += [f"| {r.model} | {r.engine} | {r.batch} | {r.tok_s:.1f} | {r.per_seq:.1f} |" for r in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--batches", type=int, nargs="*", default=list(BATCHES))
    ap.add_argument("--models", nargs="*", default=["default", *SHAPES], help="default and/or shape names")
    ap.add_argument("--json", type=Path, default=None, help="also write the rows here")
    ap.add_argument("--dry-run", action="store_true", help="CPU, float32, tiny shapes: checks the script, no figures")
    a = ap.parse_args(argv)
    if a.dry_run:
        device, dtype = torch.device("cpu"), torch.float32
        a.prompt_len, a.new_tokens, a.batches = 8, 3, [1, 4]
    elif not torch.cuda.is_available():
        print("bench_gpu_batch.py needs a CUDA device (use --dry-run to check the script on the CPU)", file=sys.stderr)
        return 2
    else:
        device, dtype = torch.device("cuda"), torch.float16
    rows: list[Row] = []
    for name in a.models:
        if name == "default":
            from webchat.loader import load_model

            model, label = load_model(default_dir(a.dry_run), device, dtype), "SmolLM2-135M-Instruct"
        elif name in SHAPES:
            model, label = random_pair(DRY_SHAPE if a.dry_run else SHAPES[name], device, dtype)[0], name
        else:
            raise SystemExit(f"unknown model {name!r}; choose from {['default', *SHAPES]}")
        model.setup_rope(a.prompt_len + a.new_tokens + 1)
        rows += sweep(label, model, a.batches, a.prompt_len, a.new_tokens)
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (dry run)"
    print(table(rows, device_name))
    if a.json is not None:
        a.json.write_text(json.dumps([asdict(r) | {"per_seq": r.per_seq} for r in rows], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
