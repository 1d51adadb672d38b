"""The C++ forward (webchat.kernels.cpu.step, csrc/qstep.cpp) against the PyTorch path it stands in for: the same logits
and the same k/v on mixed ragged batches (prefill chunks, verify rows, decodes across page boundaries), a row's numbers
independent of the rest of the batch, on each code path this CPU runs, float32 and quantized matrices alike."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from bench.tiny import make_tiny_weights, tiny_config
from webchat.kernels.backend import load_model
from webchat.kernels.cpu import build as qkernels
from webchat.kernels.cpu.step import MAX_ROWS, CpuStep, enable_cpu_step
from webchat.model.batch import Batch, make_batch
from webchat.model.kv_cache import KVPool, PageTable
from webchat.model.transformer import Transformer

PAGE = 16


@pytest.fixture(autouse=True)
def _needs_kernels(kernels: object) -> None:
    """Every test here runs the C++ forward (conftest's `kernels` skips them all without a toolchain)."""


@pytest.fixture(params=qkernels.PATHS, autouse=False)
def code_path(request: pytest.FixtureRequest, kernels: object) -> Iterator[str]:
    name = request.param
    if name not in qkernels.available_paths():
        pytest.skip(f"this CPU cannot run the {name} path")
    qkernels.load().set_path(qkernels.PATHS[name])
    yield name
    qkernels.load().set_path(-1)


# shapes: (hidden, ffn, heads, kv heads, head_dim, arch). hd 64 and 128 take the vectorised attention, 16 and 32
# the generic one; GQA 1:1, 2:1, 3:1 (SmolLM2's: a prompt's tiles 48 lanes wide), 4:1; Qwen2's q/k/v biases
SHAPES = {
    "hd16-gqa2": (64, 128, 4, 2, 16, "LlamaForCausalLM"),
    "hd64-gqa2": (128, 256, 4, 2, 64, "LlamaForCausalLM"),
    "hd64-gqa3": (192, 256, 6, 2, 64, "LlamaForCausalLM"),
    "hd128-mha": (256, 256, 2, 2, 128, "LlamaForCausalLM"),
    "hd32-gqa4-qwen2-bias": (128, 192, 8, 2, 32, "Qwen2ForCausalLM"),
}


# shapes only some tests take: hd 128 with two query heads a kv head (the 16-lane kernels' groups of 2)
MORE_SHAPES = {"hd128-gqa2": (256, 256, 4, 2, 128, "LlamaForCausalLM")}


def model_dir(root: Path, tiny_model_dir: Path, shape: str) -> Path:
    out = root / shape
    if out.exists():
        return out
    shutil.copytree(tiny_model_dir, out)
    dim, ffn, heads, kv, hd, arch = {**SHAPES, **MORE_SHAPES}[shape]
    cfg = json.loads((out / "config.json").read_text())
    cfg.update(hidden_size=dim, intermediate_size=ffn, num_attention_heads=heads, num_key_value_heads=kv,
               head_dim=hd, architectures=[arch], model_type="qwen2" if "Qwen2" in arch else "llama")
    base = tiny_config(cfg["vocab_size"])
    base.update(hidden_size=dim, intermediate_size=ffn, num_attention_heads=heads, num_key_value_heads=kv, head_dim=hd)
    weights = make_tiny_weights(base, seed=3)
    if "Qwen2" in arch:
        g = torch.Generator().manual_seed(4)
        for i in range(cfg["num_hidden_layers"]):
            for proj, n in (("q", heads), ("k", kv), ("v", kv)):
                weights[f"model.layers.{i}.self_attn.{proj}_proj.bias"] = torch.randn(n * hd, generator=g) * 0.5
    save_file(weights, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(cfg))
    return out


@pytest.fixture(scope="module")
def shapes_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("cpu-step-shapes")


def clone(pool: KVPool) -> KVPool:
    twin = KVPool.__new__(KVPool)
    twin.__dict__.update(pool.__dict__)
    twin.k, twin.v = [t.clone() for t in pool.k], [t.clone() for t in pool.v]
    return twin


def eager(model: Transformer, spec: list[tuple[list[int], int, list[int], list[int]]], pool: KVPool) -> torch.Tensor:
    runner, model.runner = model.runner, None
    try:
        return model(make_batch(spec, PAGE), pool)
    finally:
        model.runner = runner


def setup_sequences(model: Transformer) -> tuple[KVPool, list[PageTable]]:
    """Three sequences with 15, 33 and 0 tokens already cached (through the PyTorch path)."""
    pool = model.new_pool(40 * PAGE, PAGE)
    gen = torch.Generator().manual_seed(5)
    tables = []
    for ids in [torch.randint(3, 500, (n,), generator=gen).tolist() for n in (15, 33, 0)]:
        table = PageTable(pool)
        table.ensure(80)
        tables.append(table)
        if ids:
            eager(model, [(ids, 0, table.pages, [-1])], pool)
    return pool, tables


def mixed_spec(tables: list[PageTable]) -> list[tuple[list[int], int, list[int], list[int]]]:
    """A decode at position 15 (the first slot of a new page), a 4-token verify at 33 with every row's logits,
    and a 20-token prefill chunk from position 0 with its last row's logits."""
    return [([7], 15, tables[0].pages, [-1]), ([9, 10, 11, 12], 33, tables[1].pages, [0, 1, 2, 3]),
            (list(range(40, 60)), 0, tables[2].pages, [-1])]


# the decode and the verify rows follow their prompts; the prefill chunk is a prompt's (the C++ forward's GEMM rows)
PROMPT_ENDS = [15, 33, 20]


def run_both(model: Transformer, owner: Transformer) -> tuple[torch.Tensor, torch.Tensor, KVPool, KVPool,
                                                              list[PageTable]]:
    """The mixed batch through the C++ forward (owner's runner, checked to have run) and through the PyTorch path,
    on twin pools: (ours, reference, our pool, its twin, the tables)."""
    runner = owner.runner
    assert isinstance(runner, CpuStep)
    pool, tables = setup_sequences(model)
    twin = clone(pool)
    spec = mixed_spec(tables)
    calls = runner.calls
    ours = model(make_batch(spec, PAGE, prompt_ends=PROMPT_ENDS), pool)
    assert runner.calls == calls + 1
    return ours, eager(model, spec, twin), pool, twin, tables


@pytest.mark.parametrize("weights", ["float32", "q4_0", "q4_1", "q8_0"])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_cpp_forward_matches_the_pytorch_path(tiny_model_dir: Path, shapes_root: Path, shape: str, weights: str,
                                             code_path: str) -> None:
    path = model_dir(shapes_root, tiny_model_dir, shape)
    model = load_model(path, weights="float32") if weights == "float32" else load_model(path, quantize=weights,
                                                                                      precision="exact")
    ours, ref, pool, twin, tables = run_both(model, model)
    assert ours.shape == ref.shape == (6, model.args.vocab_size)
    torch.testing.assert_close(ours, ref, atol=2e-4, rtol=1e-4)
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))
    # every token's k/v landed in its slot, as the PyTorch path writes it (unwritten slots hold whatever was there)
    slots = torch.tensor([t.pages[p // PAGE] * PAGE + p % PAGE for t, n in zip(tables, (16, 37, 20), strict=True)
                          for p in range(n)])
    for layer in range(model.args.n_layers):
        for ours_kv, ref_kv in ((pool.k[layer], twin.k[layer]), (pool.v[layer], twin.v[layer])):
            flat = ours_kv.flatten(0, 1).index_select(0, slots), ref_kv.flatten(0, 1).index_select(0, slots)
            torch.testing.assert_close(*flat, atol=1e-5, rtol=1e-5)


# Gemma in the C++ forward: windows of 7 that start mid-page in every kind of row (the decode at 15, the verify at
# 33-36, the prefill chunk's later rows), soft caps, a score scale other than 1/sqrt(hd), post norms, GELU-tanh, Gemma
# 3's q/k norms and local rope; hd 64 takes the vectorised attention, hd 32 the generic one
GEMMA_SHAPE = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, query_pre_attn_scalar=48, sliding_window=7,
                   layer_types=["sliding_attention", "full_attention"])
GEMMAS = {
    "gemma2-hd64": ("Gemma2Config", dict(head_dim=64, attn_logit_softcapping=1.5, final_logit_softcapping=2.0)),
    "gemma3-hd32": ("Gemma3TextConfig", dict(
        head_dim=32, rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                      "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6}})),
}


@pytest.mark.parametrize("kind", list(GEMMAS))
def test_gemma_in_cpp_matches_the_pytorch_path(shapes_root: Path, kind: str, code_path: str) -> None:
    transformers = pytest.importorskip("transformers", reason="transformers builds the Gemma checkpoints")
    from test_archs import random_model

    folder = shapes_root / kind
    if not folder.exists():
        config, extra = GEMMAS[kind]
        random_model(getattr(transformers, config)(**GEMMA_SHAPE, **extra), folder)
    for model in (load_model(folder, weights="float32"), load_model(folder, quantize="q8_0", precision="exact")):
        ours, ref, *_ = run_both(model, model)
        torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)
        assert torch.equal(ours.argmax(-1), ref.argmax(-1))


@pytest.mark.parametrize("kind", [None, "f16", "q8_0"])
def test_a_cpu_pool_keeps_each_heads_slots_together_and_reads_as_a_slot_major_one(tiny_model_dir: Path,
                                                                                  shapes_root: Path, kind: str | None,
                                                                                  code_path: str) -> None:
    """A CPU pool lays each kv head's slots one after another (a decode reads a head's keys as one run); the C++
    forward reads it by its strides, so the same values laid slot-major give the same bits and the same writes."""
    model = load_model(model_dir(shapes_root, tiny_model_dir, "hd64-gqa3"), quantize="q4_1", precision="exact")
    model.kv_cache = kind
    pool, tables = setup_sequences(model)
    k = pool.k[0]
    n_pages, page, n_kv, row = k.shape
    assert k.stride() == (page * row, row, n_pages * page * row, 1)  # head-major: a head's slots contiguous
    twin = clone(pool)
    twin.k, twin.v = [t.contiguous() for t in pool.k], [t.contiguous() for t in pool.v]
    assert twin.k[0].stride() == (page * n_kv * row, n_kv * row, row, 1)
    spec = mixed_spec(tables)
    head_major = model(make_batch(spec, PAGE, prompt_ends=PROMPT_ENDS), pool)
    slot_major = model(make_batch(spec, PAGE, prompt_ends=PROMPT_ENDS), twin)
    assert torch.equal(head_major, slot_major)
    for ours, theirs in zip((*pool.k, *pool.v), (*twin.k, *twin.v), strict=True):
        assert torch.equal(ours, theirs)
    # a pool whose pages are not one stride of slots apart is refused, not misread
    odd = clone(pool)
    odd.k = [t.transpose(0, 1).contiguous().transpose(0, 1) for t in pool.k]
    with pytest.raises(RuntimeError, match="a page's slots one stride apart"):
        model(make_batch(spec, PAGE, prompt_ends=PROMPT_ENDS), odd)


@pytest.mark.parametrize("precision", ["exact", "int8"])
@pytest.mark.parametrize("shape", ["hd64-gqa2", "hd32-gqa4-qwen2-bias"])
def test_a_rows_logits_do_not_depend_on_the_batch(tiny_model_dir: Path, shapes_root: Path, shape: str,
                                                  code_path: str, precision: str) -> None:
    """Each sequence alone gives bit-identical logits to the same sequence inside the mixed batch, its prefill chunk
    taken as prompt rows (the GEMM) or not (the row kernels), with float32 or int8 activations."""
    model = load_model(model_dir(shapes_root, tiny_model_dir, shape), quantize="q4_1", precision=precision)
    for ends in (None, PROMPT_ENDS):
        pool, tables = setup_sequences(model)
        twin = clone(pool)
        spec = mixed_spec(tables)
        together = model(make_batch(spec, PAGE, prompt_ends=ends), pool)
        alone = torch.cat([model(make_batch([s], PAGE, prompt_ends=None if ends is None else [e]), twin)
                           for s, e in zip(spec, ends or [0] * len(spec), strict=True)])
        assert torch.equal(together, alone)


@pytest.mark.parametrize("weights", ["float32", "q4_1", "q4_1-int8"])
def test_a_prompt_is_computed_alike_however_it_is_chunked(tiny_model_dir: Path, shapes_root: Path, weights: str,
                                                           code_path: str) -> None:
    """Bit for bit: a prompt's k/v and its last row's logits fed whole, in chunks of 1, 7 and 22, or row by row
    (a GEMM row depends on its own x only), so a recomputation after a preemption meets the same cache. (The
    K-quants' int8 GEMM: tests/kernels/test_int8.py.)"""
    path = model_dir(shapes_root, tiny_model_dir, "hd64-gqa2")
    precision = "int8" if weights.endswith("-int8") else "exact"
    model = (load_model(path, weights="float32") if weights == "float32"
             else load_model(path, quantize=weights.removesuffix("-int8"), precision=precision))
    runner = model.runner
    assert isinstance(runner, CpuStep)
    ids = torch.randint(3, 500, (30,), generator=torch.Generator().manual_seed(8)).tolist()

    def feed(chunks: list[int], prompt: bool = True) -> tuple[torch.Tensor, list[torch.Tensor]]:
        pool = model.new_pool(8 * PAGE, PAGE)
        table = PageTable(pool)
        table.ensure(len(ids))
        start, calls = 0, runner.calls
        for n in chunks:
            logits = model(make_batch([(ids[start : start + n], start, table.pages, [-1])], PAGE,
                                      prompt_ends=[len(ids) if prompt else 0]), pool)
            start += n
        assert start == len(ids) and runner.calls == calls + len(chunks)
        slots = torch.tensor([table.pages[p // PAGE] * PAGE + p % PAGE for p in range(len(ids))])
        return logits, [t.flatten(0, 1).index_select(0, slots) for t in pool.k + pool.v]

    whole, whole_kv = feed([30])
    for chunks in ([1, 7, 22], [1] * 30):
        logits, kv = feed(chunks)
        assert torch.equal(logits, whole), chunks
        assert all(torch.equal(a, b) for a, b in zip(kv, whole_kv, strict=True)), chunks
    if weights != "float32":
        _, row_kv = feed([30], prompt=False)
        same = all(torch.equal(a, b) for a, b in zip(row_kv, whole_kv, strict=True))
        # the same rows as non-prompt rows take the attention's row kernels (a prompt's take qattn.h's tiles) and,
        # exact, the matmul's row kernels: other roundings, so other bits
        assert not same
        if weights == "q4_1-int8":  # a 32-value format's prompt rows take the int8 row kernels too: the first
            # layer's k/v (made before any attention) are the same bits
            layers = len(row_kv) // 2
            assert torch.equal(row_kv[0], whole_kv[0]) and torch.equal(row_kv[layers], whole_kv[layers])


@pytest.mark.parametrize("shape", ["hd64-gqa2", "hd64-gqa3", "hd128-gqa2"])
def test_attention_units_split_a_head_each_give_the_bits_of_whole_ones(tiny_model_dir: Path, shapes_root: Path,
                                                                      code_path: str, shape: str) -> None:
    """qstep.cpp's attention takes a prefill or verify chunk in units of up to 8 rows with every query head of a kv
    group, and splits them a query head each where a step makes under 8 a thread (so 2 threads share 3 kv groups
    evenly). A prompt of 40 rows a thread fed whole makes 5 chunks x 2 kv groups a thread, enough to go as they are;
    fed as all but 8 rows and then 8 (the 8 split), or in verify-sized chunks of 5 and 9 (every one split), every
    row's logits and k/v must be the same bits. On the AVX-512 path a whole unit's query heads go through the
    kernels 2 or 3 at a time (each key read once for them), a split one's one at a time."""
    model = load_model(model_dir(shapes_root, tiny_model_dir, shape), quantize="q4_1", precision="int8")
    assert isinstance(model.runner, CpuStep)
    n = 40 * torch.get_num_threads()
    ids = torch.randint(3, 500, (n,), generator=torch.Generator().manual_seed(9)).tolist()

    def feed(chunks: list[int]) -> tuple[torch.Tensor, list[torch.Tensor]]:
        pool = model.new_pool(n + 2 * PAGE, PAGE)
        table = PageTable(pool)
        table.ensure(len(ids))
        start, rows, calls = 0, [], model.runner.calls
        for size in chunks:
            rows.append(model(make_batch([(ids[start : start + size], start, table.pages, list(range(size)))], PAGE),
                              pool))
            start += size
        assert start == n and model.runner.calls == calls + len(chunks)
        slots = torch.tensor([table.pages[p // PAGE] * PAGE + p % PAGE for p in range(len(ids))])
        return torch.cat(rows), [t.flatten(0, 1).index_select(0, slots) for t in pool.k + pool.v]

    whole, whole_kv = feed([n])
    verifies = [5, 9] * (n // 14) + ([n % 14] if n % 14 else [])
    for chunks in ([n - 8, 8], verifies):
        logits, kv = feed(chunks)
        assert torch.equal(logits, whole), chunks
        assert all(torch.equal(a, b) for a, b in zip(kv, whole_kv, strict=True)), chunks


@pytest.mark.parametrize("kind", ["f16", "q8_0"])
@pytest.mark.parametrize("shape", ["hd64-gqa2", "hd128-mha", "hd32-gqa4-qwen2-bias", "hd16-gqa2"])
def test_a_float16_or_q8_0_cache_in_cpp_matches_the_pytorch_path(tiny_model_dir: Path, shapes_root: Path, shape: str,
                                                                 kind: str, code_path: str) -> None:
    """`--kv-cache f16|q8_0` (webchat.model.kv_format) on the C++ forward: the mixed batch's logits as the PyTorch path
    computes them on the same format; the first layer's k/v (the same floats whichever the cache) stored as the same
    bytes kv_format.encode makes of the float32 pool's rows, and every layer's within one step of the format."""
    from webchat.model import kv_format

    path = model_dir(shapes_root, tiny_model_dir, shape)
    if kind == "q8_0" and SHAPES[shape][4] % 32:
        with pytest.raises(ValueError, match="multiple of 32"):
            kv_format.check(kind, SHAPES[shape][4])
        return
    model = load_model(path, quantize="q4_1", precision="exact")  # (int8 rounds differently on torch's norms)
    plain, _, plain_pool, _, _ = run_both(model, model)
    model.kv_cache = kind
    ours, ref, pool, twin, tables = run_both(model, model)
    assert pool.k[0].dtype == (torch.float16 if kind == "f16" else torch.uint8)
    # the two paths' k/v differ in float32 rounding, and q8_0 can store such a pair a step (1/127 of its block's largest
    # value) apart: a few logits move by up to ~1e-2 there; a wrong byte or block moves them by ~1
    torch.testing.assert_close(ours, ref, atol=2e-3 if kind == "f16" else 3e-2, rtol=1e-3)
    assert (ours - plain).abs().max().item() > 1e-4  # the format is what the step read
    slots = torch.tensor([t.pages[p // PAGE] * PAGE + p % PAGE for t, n in zip(tables, (16, 37, 20), strict=True)
                          for p in range(n)])
    hd = SHAPES[shape][4]

    def rows(t: torch.Tensor) -> torch.Tensor:
        return t.flatten(0, 1).index_select(0, slots)

    for f32_layer, layer in ((plain_pool.k[0], pool.k[0]), (plain_pool.v[0], pool.v[0])):
        assert torch.equal(rows(layer), kv_format.encode(rows(f32_layer), layer))
    for layer in range(model.args.n_layers):
        for mine, theirs in ((pool.k[layer], twin.k[layer]), (pool.v[layer], twin.v[layer])):
            a, b = kv_format.decode(rows(mine), hd), kv_format.decode(rows(theirs), hd)
            step = b.abs().amax(-1, keepdim=True) / (127 if kind == "q8_0" else 1024)
            assert bool(((a - b).abs() <= step * 1.01 + 1e-6).all()), layer


@pytest.mark.parametrize(("rows", "shape"),
                         [("generated", "hd64-gqa2"), ("prompt", "hd64-gqa2"), ("prompt", "hd64-gqa3")])
def test_past_one_segment_of_keys_a_row_is_the_same_decoded_or_in_a_chunk(
        tiny_model_dir: Path, shapes_root: Path, code_path: str, rows: str, shape: str) -> None:
    """Rows with more keys than one of attention's segments (qstep.cpp SEG_KEYS, 1,024 positions): a decode row's
    segments are units of their own, folded after; a chunk's rows fold theirs as they go. Rows 2,140-2,199 fed in
    chunks or one row at a time give the same bits, as generated rows (the row kernels: speculation's verify rows must
    give a decode's) and as a prompt's (qattn.h's tiles: a prompt resent or extended meets the cache it made), and
    agree with the PyTorch path. A prompt's chunk past one segment makes a unit per kv group and segment, folded
    after as a decode row's are; 3 query heads a kv head take 48-lane tiles."""
    model = load_model(model_dir(shapes_root, tiny_model_dir, shape), quantize="q4_1", precision="int8")
    n, split = 2200, 2140  # three segments
    model.ensure_rope(n)  # past the tiny config's 1,024 positions (a random model: any rope row will do)
    ids = torch.randint(3, 500, (n,), generator=torch.Generator().manual_seed(11)).tolist()

    def feed(chunks: list[int], pool: KVPool, table: PageTable, start: int = 0) -> torch.Tensor:
        out = []
        for size in chunks:
            out.append(model(make_batch([(ids[start : start + size], start, table.pages, list(range(size)))], PAGE,
                                         prompt_ends=[n if rows == "prompt" or start < split else split]), pool))
            start += size
        return torch.cat(out)

    def fresh() -> tuple[KVPool, PageTable]:
        pool = model.new_pool(n + 2 * PAGE, PAGE)
        table = PageTable(pool)
        table.ensure(n)
        return pool, table

    pool, table = fresh()
    whole = feed([64] * (split // 64) + [split % 64, n - split], pool, table)[split:]
    pool, table = fresh()
    feed([64] * (split // 64) + [split % 64], pool, table)
    twin = clone(pool)
    one_by_one = feed([1] * (n - split), pool, table, split)
    assert torch.equal(one_by_one, whole)
    runner, model.runner = model.runner, None
    try:
        ref = torch.cat([model(make_batch([([t], split + i, table.pages, [0])], PAGE, prompt_ends=[n]), twin)
                         for i, t in enumerate(ids[split:n])])
    finally:
        model.runner = runner
    torch.testing.assert_close(one_by_one, ref, atol=0.25, rtol=0)  # int8 on torch's norms: within 0.2 (test_int8)
    top2 = ref.topk(2, -1).values
    decided = top2[:, 0] - top2[:, 1] > 0.5  # within 0.25 each, the top token can only change where two are closer
    assert decided.sum() >= len(decided) // 4
    assert torch.equal(one_by_one.argmax(-1)[decided], ref.argmax(-1)[decided])


@pytest.mark.parametrize("shape", ["hd64-gqa2", "hd64-gqa3", "hd128-mha"])
def test_a_prompts_attention_tiles_give_every_vector_path_the_same_bits(tiny_model_dir: Path, shapes_root: Path,
                                                                        shape: str) -> None:
    """qattn.h's tiles run the same chains on AVX2 and AVX-512 (a lane per row, 8 or 16 to a vector): a prompt's
    logits and every layer's k/v agree bit for bit across the vector paths this CPU runs (int8 weights, whose row
    kernels agree too), where the row kernels' horizontal sums do not."""
    paths = [p for p in ("avx2", "avx512") if p in qkernels.available_paths()]
    if len(paths) < 2:
        pytest.skip("this CPU runs one vector path")
    model = load_model(model_dir(shapes_root, tiny_model_dir, shape), quantize="q4_1", precision="int8")
    ids = torch.randint(3, 500, (300,), generator=torch.Generator().manual_seed(5)).tolist()
    runs = []
    try:
        for name in paths:
            qkernels.load().set_path(qkernels.PATHS[name])
            pool = model.new_pool(320, PAGE)
            table = PageTable(pool)
            table.ensure(len(ids))
            logits = [model(make_batch([(ids[a : a + 64], a, table.pages, [-1])], PAGE, prompt_ends=[len(ids)]), pool)
                      for a in range(0, len(ids), 64)]
            slots = torch.tensor([table.pages[p // PAGE] * PAGE + p % PAGE for p in range(len(ids))])
            runs.append((torch.cat(logits), [t.flatten(0, 1).index_select(0, slots) for t in pool.k + pool.v]))
    finally:
        qkernels.load().set_path(-1)
    (logits_a, kv_a), (logits_b, kv_b) = runs
    assert torch.equal(logits_a, logits_b)
    assert all(torch.equal(a, b) for a, b in zip(kv_a, kv_b, strict=True))


def test_self_draft_truncation_runs_in_cpp_and_matches(tiny_model_dir: Path, shapes_root: Path) -> None:
    model = load_model(model_dir(shapes_root, tiny_model_dir, "hd64-gqa2"), quantize="q8_0", precision="exact")
    ours, ref, *_ = run_both(model.truncated(1), model)  # the first layer only, on the full model's C++ step
    torch.testing.assert_close(ours, ref, atol=2e-4, rtol=1e-4)


def test_long_chunks_take_the_pytorch_path(tiny_model_dir: Path) -> None:
    model = load_model(tiny_model_dir)
    assert isinstance(model.runner, CpuStep)
    cache = model.new_cache(256)
    calls = model.runner.calls
    cache.feed(model, list(range(3, 3 + MAX_ROWS + 1)))
    assert model.runner.calls == calls  # 65 rows: a GEMM-sized chunk, run by PyTorch
    cache.feed(model, [5])
    assert model.runner.calls == calls + 1


def test_a_bad_batch_is_an_error_not_a_wild_write(tiny_model_dir: Path) -> None:
    model = load_model(tiny_model_dir)
    assert isinstance(model.runner, CpuStep)
    pool = model.new_pool(4 * PAGE, PAGE)
    table = PageTable(pool)
    table.ensure(8)
    good = make_batch([([5, 6], 0, table.pages, [-1])], PAGE)
    for field, value, message in [
            ("slot_mapping", [1, 10_000], "slot 10000 is outside the pool"),
            ("tokens", [5, 100_000], "token 100000 is out of range"),
            ("positions", [0, 400], "position 400 of row 1 is outside"),
            ("logit_rows", [7], "logit row 7 out of range")]:
        bad = make_batch([([5, 6], 0, table.pages, [-1])], PAGE)  # the host lists the step reads (HostRows)
        assert bad.rows is not None
        setattr(bad.rows, field, value)
        with pytest.raises(RuntimeError, match=message):
            model(bad, pool)
        tensors = {name: getattr(good, name) for name in Batch.TENSORS}  # a batch of tensors (the other entry)
        bad = Batch(**{**tensors, field: torch.tensor(value, dtype=torch.long)}, max_seq_len=good.max_seq_len)
        with pytest.raises(RuntimeError, match=message):
            model(bad, pool)
    bad = make_batch([([5, 6], 0, table.pages, [-1])], PAGE)
    assert bad.rows is not None
    bad.rows.query_start = [0, 5]
    with pytest.raises(RuntimeError, match="query_start must run from 0 to 2"):
        model(bad, pool)
    bad = make_batch([([5, 6], 0, table.pages, [-1])], PAGE)
    assert bad.rows is not None
    bad.rows.block_tables = bad.rows.block_tables[:-1]
    with pytest.raises(RuntimeError, match="block_tables must hold"):
        model(bad, pool)
    assert model(good, pool).shape == (1, model.args.vocab_size)  # and it still runs


def test_switched_off_by_environment(tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WEBCHAT_CPU_STEP", "0")
    model = load_model(tiny_model_dir)
    assert model.runner is None
    assert not enable_cpu_step(model, qkernels.load())
    monkeypatch.setenv("WEBCHAT_CPU_STEP", "1")
    assert enable_cpu_step(model, qkernels.load()) and isinstance(model.runner, CpuStep)
    assert not enable_cpu_step(model, None)  # no kernels: the PyTorch path
