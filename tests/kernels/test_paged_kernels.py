"""The paged-cache kernels (kernels/cuda/kv_write.cu, kernels/cuda/paged_attention.cu) against
webchat.model.ops.PagedTorchOps on fresh random data: pages in scattered order, ragged lengths across page boundaries,
GQA, decode rows, a chunked-prefill row set, a verify row set (1+k tokens) and padding rows; every input and output
inside NaN guards, and the cache's unused slots NaN, so any read outside a sequence's keys shows. On the GPU and
everywhere through the CPU emulator."""

from __future__ import annotations

import math

import pytest
import torch
from test_kernels import ATTN_TOL, BACKENDS, DTYPES, Recorder, ScalarReads, backend_ops, close, guards_intact, poisoned

from webchat.kernels.cuda import CudaOps, KernelInputError, launch
from webchat.kernels.cuda.emulator import emulated_launcher
from webchat.model.batch import Batch, make_batch
from webchat.model.ops import PagedTorchOps


@pytest.fixture(scope="module", params=BACKENDS)
def ops(request: pytest.FixtureRequest) -> CudaOps:
    return backend_ops(request.param)


def randn(*shape: int, dtype: torch.dtype, device: torch.device, scale: float = 1.0) -> torch.Tensor:
    """Random normal values (drawn on the CPU from torch's global generator) inside NaN guards."""
    return poisoned(torch.empty(shape, dtype=dtype, device=device)).copy_(torch.randn(*shape) * scale)


def scattered_pages(counts: list[int], spare: int) -> tuple[list[list[int]], int]:
    """Page lists of the given lengths drawn in random order from 1.. (page 0 is never handed out), `spare` pages left
    unused; returns (pages per sequence, pool size)."""
    n_pages = 1 + sum(counts) + spare
    perm = (torch.randperm(n_pages - 1) + 1).tolist()
    out, at = [], 0
    for n in counts:
        out.append(perm[at : at + n])
        at += n
    return out, n_pages


class Case:
    """A pool of NaN pages; each sequence's cached keys written (by the reference); a batch of its new rows."""

    def __init__(self, seqs: list[tuple[int, int]], page_size: int, heads: tuple[int, int, int], dtype: torch.dtype,
                 device: torch.device, seed: int) -> None:  # fmt: skip
        torch.manual_seed(seed)
        n_heads, n_kv, hd = heads
        counts = [math.ceil((cached + new) / page_size) for cached, new in seqs]
        pages, n_pages = scattered_pages(counts, spare=2)
        empty = torch.empty((n_pages, page_size, n_kv, hd), dtype=dtype, device=device)
        self.k_cache, self.v_cache = poisoned(empty), poisoned(empty)  # NaN wherever nothing was written
        for (cached, _), p in zip(seqs, pages, strict=True):
            if cached:
                old = make_batch([(list(range(cached)), 0, p, [-1])], page_size, device)
                k, v = (randn(cached, n_kv, hd, dtype=dtype, device=device, scale=2.0) for _ in range(2))
                PagedTorchOps.kv_write(self.k_cache, self.v_cache, k, v, old.slot_mapping)
        self.batch = make_batch([(list(range(new)), cached, p, [-1]) for (cached, new), p in zip(seqs, pages,
                                strict=True)], page_size, device)  # fmt: skip
        t = self.batch.tokens.shape[0]
        self.k, self.v = (randn(t, n_kv, hd, dtype=dtype, device=device, scale=2.0) for _ in range(2))
        self.q = randn(t, n_heads, hd, dtype=dtype, device=device, scale=2.0)

    def write_new(self) -> None:
        PagedTorchOps.kv_write(self.k_cache, self.v_cache, self.k, self.v, self.batch.slot_mapping)

    def reference(self, **kw: float) -> torch.Tensor:
        # float32 of the same inputs, rounded once to the dtype: the truth both implementations approximate. A fresh
        # Batch of the same tensors: the reference may keep a plan on the batch it saw, and the lengths may change
        # Page 0 (NaN here, never written) is zero for the reference, which may gather it as masked padding
        q, kc, vc = self.q.float(), self.k_cache.float(), self.v_cache.float()
        kc[0], vc[0] = 0.0, 0.0
        batch = Batch(**{name: getattr(self.batch, name) for name in Batch.TENSORS}, max_seq_len=self.batch.max_seq_len)
        return PagedTorchOps.paged_attention(q, kc, vc, batch, **kw).to(self.q.dtype)  # type: ignore[arg-type]


# (cached, new) per sequence, page_size, (n_heads, n_kv, head_dim)
PAGED_CASES = {
    "decode": ([(0, 1), (15, 1), (16, 1), (40, 1), (63, 1)], 16, (8, 2, 64)),
    "chunked-prefill": ([(0, 7), (20, 9), (5, 1), (31, 1)], 8, (6, 3, 32)),
    "verify": ([(12, 4), (3, 3), (29, 5), (0, 1)], 4, (4, 4, 80)),
    "long-context": ([(290, 1), (17, 2)], 32, (4, 1, 128)),
    "head-dim-256": ([(9, 1), (2, 2)], 16, (2, 1, 256)),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", sorted(PAGED_CASES))
def test_paged_attention(ops: CudaOps, dtype: torch.dtype, name: str) -> None:
    seqs, page_size, heads = PAGED_CASES[name]
    case = Case(seqs, page_size, heads, dtype, ops.device, seed=len(name))
    case.write_new()
    out = ops.paged_attention(case.q, case.k_cache, case.v_cache, case.batch, out=poisoned(case.q))
    close(out, case.reference(), ATTN_TOL[dtype])


# Gemma's attention: a sliding window that cuts keys mid-page and mid-split (decode rows up to 63 keys, chunk and
# verify rows), a soft cap, a score scale other than 1/sqrt(hd), and all three at once
GEMMA_ATTENTION = {
    "window-5": dict(window=5),
    "window-20": dict(window=20),
    "cap-1.5": dict(softcap=1.5),
    "scale": dict(scale=0.07),
    "window-cap-scale": dict(window=9, softcap=2.0, scale=0.2),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case_name", ["decode", "chunked-prefill", "verify"])
@pytest.mark.parametrize("kind", sorted(GEMMA_ATTENTION))
def test_paged_attention_with_window_cap_and_scale(ops: CudaOps, dtype: torch.dtype, case_name: str,
                                                   kind: str) -> None:
    seqs, page_size, heads = PAGED_CASES[case_name]
    case = Case(seqs, page_size, heads, dtype, ops.device, seed=len(case_name))
    case.write_new()
    kw = GEMMA_ATTENTION[kind]
    out = ops.paged_attention(case.q, case.k_cache, case.v_cache, case.batch, out=poisoned(case.q), **kw)
    want = case.reference(**kw)
    close(out, want, ATTN_TOL[dtype])
    assert not torch.allclose(want.float(), case.reference().float(), rtol=1e-3, atol=1e-3)  # the setting matters


def padded(batch: Batch, extra_rows: int) -> Batch:
    """batch plus an empty sequence (no rows, length 0) and `extra_rows` rows past the last sequence (CUDA-graph
    padding): they write to page 0 and read nothing."""
    dev = batch.tokens.device
    t = batch.tokens.shape[0]

    def more(x: torch.Tensor, value: int, n: int) -> torch.Tensor:
        return torch.cat([x, torch.full((n, *x.shape[1:]), value, dtype=x.dtype, device=dev)])

    return Batch(tokens=more(batch.tokens, 0, extra_rows), positions=more(batch.positions, 0, extra_rows),
                 slot_mapping=more(batch.slot_mapping, 0, extra_rows), query_start=more(batch.query_start, t, 1),
                 seq_lens=more(batch.seq_lens, 0, 1), block_tables=more(batch.block_tables, 0, 1),
                 logit_rows=batch.logit_rows, max_seq_len=batch.max_seq_len)  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_padding_rows_and_empty_sequences_read_nothing(ops: CudaOps, dtype: torch.dtype) -> None:
    case = Case([(5, 1), (17, 1)], 8, (4, 2, 32), dtype, ops.device, seed=3)
    case.write_new()
    batch = padded(case.batch, extra_rows=3)
    q = torch.cat([case.q, randn(3, 4, 32, dtype=dtype, device=ops.device)])
    out = ops.paged_attention(q, case.k_cache, case.v_cache, batch, out=poisoned(q))
    assert not out.isnan().any(), "a padding row read NaN (page 0 was never written) or was left unwritten"
    guards_intact(out)
    torch.testing.assert_close(out[2:], torch.zeros_like(out[2:]), rtol=0, atol=0)
    torch.testing.assert_close(out[:2], case.reference(), rtol=ATTN_TOL[dtype][0], atol=ATTN_TOL[dtype][1])


@pytest.mark.parametrize("dtype", DTYPES)
def test_kv_write(ops: CudaOps, dtype: torch.dtype) -> None:
    torch.manual_seed(11)
    n_pages, page_size, n_kv, hd, t = 9, 4, 3, 40, 13
    k, v = (randn(t, n_kv, hd, dtype=dtype, device=ops.device) for _ in range(2))
    slots = (torch.randperm(n_pages * page_size - page_size)[:t] + page_size).to(ops.device)  # scattered, not page 0
    empty = torch.empty((n_pages, page_size, n_kv, hd), dtype=dtype, device=ops.device)
    k_cache, v_cache = poisoned(empty), poisoned(empty)
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    PagedTorchOps.kv_write(ref_k, ref_v, k, v, slots)
    ops.kv_write(k_cache, v_cache, k, v, slots)
    for got, want in ((k_cache, ref_k), (v_cache, ref_v)):
        torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)  # untouched slots stay NaN
        guards_intact(got)


def test_kv_write_ignores_slots_outside_the_cache(ops: CudaOps) -> None:
    empty = torch.empty((2, 4, 1, 32), device=ops.device)
    k_cache, v_cache = poisoned(empty), poisoned(empty)
    k = randn(3, 1, 32, dtype=torch.float32, device=ops.device)
    ops.kv_write(k_cache, v_cache, k, k, torch.tensor([-1, 8, 5], device=ops.device))
    assert int(k_cache.isnan().sum()) == 7 * 32 and torch.equal(k_cache[1, 1, 0], k[2, 0])
    guards_intact(k_cache)


def test_paged_step_reads_no_scalar_on_the_host() -> None:
    # kv_write + paged_attention as a CUDA graph captures them: every length comes from a device tensor
    ops = backend_ops("emulated")
    case = Case([(9, 1), (0, 3)], 8, (4, 2, 32), torch.float32, ops.device, seed=5)
    with ScalarReads() as mode:
        ops.kv_write(case.k_cache, case.v_cache, case.k, case.v, case.batch.slot_mapping)
        out = ops.paged_attention(case.q, case.k_cache, case.v_cache, case.batch)
    assert mode.reads == []
    torch.testing.assert_close(out, case.reference(), rtol=1e-4, atol=2e-5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_paged_attention_gives_the_same_bits_in_either_thread_order(dtype: torch.dtype) -> None:
    # the splits merge their warps through __shared__ memory: a missing barrier would change the bits
    fwd = backend_ops("emulated")
    rev = CudaOps("cpu", launcher=emulated_launcher(reverse=True), n_sm=132)
    seqs, page_size, heads = PAGED_CASES["chunked-prefill"]
    case = Case(seqs, page_size, heads, dtype, fwd.device, seed=9)
    case.write_new()
    a = fwd.paged_attention(case.q, case.k_cache, case.v_cache, case.batch)
    assert torch.equal(a, rev.paged_attention(case.q, case.k_cache, case.v_cache, case.batch))


@pytest.mark.gpu
def test_paged_attention_graph_replays_any_lengths() -> None:
    # captured once against static batch tensors; replayed after other lengths and positions are copied in
    ops = backend_ops("cuda")
    case = Case([(40, 1), (3, 1)], 16, (8, 2, 64), torch.float16, ops.device, seed=8)
    case.write_new()
    batch, out = case.batch, poisoned(case.q)
    batch.max_seq_len = batch.block_tables.shape[1] * 16  # the grid is sized for the whole table
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        ops.paged_attention(case.q, case.k_cache, case.v_cache, batch, out=out)  # warm-up: compiles
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ops.paged_attention(case.q, case.k_cache, case.v_cache, batch, out=out)
    for lens in ((41, 4), (1, 2), (30, 4)):
        batch.seq_lens.copy_(torch.tensor(lens, dtype=torch.int32))
        batch.positions.copy_(torch.tensor(lens) - 1)
        out.fill_(float("nan"))
        graph.replay()
        close(out, case.reference(), ATTN_TOL[torch.float16])


# ---- anywhere: input checks, launch geometry ----


def test_paged_splits_come_from_host_bounds() -> None:
    rec = Recorder()
    ops = CudaOps("cpu", launcher=rec, n_sm=132)
    cache = torch.zeros(64, 16, 2, 64)
    one = make_batch([([1], 3000, list(range(1, 189)), [-1])], 16)
    short = make_batch([([1], 0, [1, 2, 3, 4], [-1])], 16)
    ops.paged_attention(torch.zeros(1, 8, 64), cache, cache, one)
    ops.paged_attention(torch.zeros(1, 8, 64), cache, cache, short)
    short.max_seq_len = 0  # unknown: sized for the tables' width (4 pages, 64 keys)
    ops.paged_attention(torch.zeros(1, 8, 64), cache, cache, short)
    long_, one_key, width = (p for p, _ in rec.launches[::2])
    assert long_.grid == (33, 8, 1)  # ceil(2 * 132 / 8) splits
    assert one_key.grid == (1, 8, 1)
    assert width.grid == (4, 8, 1)  # 64 keys, at least 16 a split
    assert all(p.block == (launch.ATTENTION_THREADS, 1, 1) for p in (long_, one_key, width))


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda o, b: o.kv_write(torch.zeros(4, 2, 8), torch.zeros(4, 2, 8), torch.zeros(1, 2, 8),
                                 torch.zeros(1, 2, 8), torch.zeros(1, dtype=torch.long)),
         r"k_cache must have shape \(num_pages, page_size, n_kv, head_dim\), got \(4, 2, 8\)"),
        (lambda o, b: o.kv_write(torch.zeros(4, 2, 1, 8), torch.zeros(4, 2, 1, 8), torch.zeros(2, 1, 8),
                                 torch.zeros(2, 1, 8), torch.zeros(2, dtype=torch.int32)),
         r"slot_mapping must have dtype torch.int64, got torch.int32"),
        (lambda o, b: o.kv_write(torch.zeros(4, 2, 1, 8), torch.zeros(4, 2, 1, 8), torch.zeros(2, 2, 8),
                                 torch.zeros(2, 2, 8), torch.zeros(2, dtype=torch.long)),
         r"k must have shape \(\*, 1, 8\), got \(2, 2, 8\)"),
        (lambda o, b: o.paged_attention(torch.zeros(1, 3, 8), torch.zeros(4, 2, 2, 8), torch.zeros(4, 2, 2, 8), b),
         r"n_heads a multiple of n_kv, got T=1, 3 and 2"),
        (lambda o, b: o.paged_attention(torch.zeros(1, 2, 8), torch.zeros(4, 2, 2, 8), torch.zeros(4, 2, 1, 8), b),
         r"v_cache must have shape \(4, 2, 2, 8\), got \(4, 2, 1, 8\)"),
        (lambda o, b: o.paged_attention(torch.zeros(2, 2, 8), torch.zeros(4, 2, 2, 8), torch.zeros(4, 2, 2, 8), b),
         r"batch.positions must have shape \(2\), got \(1,\)"),
        (lambda o, b: o.paged_attention(torch.zeros(1, 2, 16), torch.zeros(4, 2, 2, 8), torch.zeros(4, 2, 2, 8), b),
         r"k_cache must have head_dim 16 like q, got 8"),
    ],
)  # fmt: skip
def test_paged_wrappers_reject_bad_inputs(call: object, message: str) -> None:
    rec = Recorder()
    batch = make_batch([([1], 0, [1], [-1])], 2)
    with pytest.raises(KernelInputError, match=message):
        call(CudaOps("cpu", launcher=rec, n_sm=8), batch)  # type: ignore[operator]
    assert rec.launches == []
