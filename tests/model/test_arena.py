"""A CPU model's weights in one huge-page-advised mapping (webchat.model.arena): the same values, ties kept, the
checkpoint's file pages let go; the CPU KV pool in huge-page-advised mappings of its own."""

from __future__ import annotations

import mmap
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from torch import nn

from webchat.kernels.backend import load_model
from webchat.model.arena import HUGE, empty_on_huge_pages, into_huge_pages
from webchat.model.kv_cache import KVPool

linux_thp = pytest.mark.skipif(not Path("/proc/self/smaps").exists() or not hasattr(mmap, "MADV_HUGEPAGE"),
                               reason="needs Linux's /proc/self/smaps and MADV_HUGEPAGE")


def mapping_of(ptr: int) -> tuple[int, int, str]:
    """(start, end, VmFlags) of this process's mapping that holds address ptr."""
    start = end = 0
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            start, end = lo, hi
        elif line.startswith("VmFlags:") and start <= ptr < end:
            return start, end, line
    raise AssertionError(f"no mapping holds {ptr:#x}")


@linux_thp
def test_a_loaded_cpu_model_lives_in_one_huge_page_mapping_with_the_files_values(real_model_dir: Path) -> None:
    model = load_model(real_model_dir)
    params = list(model.parameters())
    spans = {mapping_of(p.data_ptr()) for p in params}
    assert len(spans) == 1, spans  # every tensor moved, the small ones too (none keeps the file mapped)
    start, end, flags = spans.pop()
    assert " hg" in flags, flags  # advised for transparent huge pages
    for p in params:
        assert start <= p.data_ptr() and p.data_ptr() + p.numel() * p.element_size() <= end
    with safe_open(str(real_model_dir / "quantized.safetensors"), framework="pt") as f:
        embed = f.get_tensor("model.embed_tokens.weight")
    table = model.tok_embeddings.weight.data
    if model.tok_embeddings.packed:  # int8: the tied head's rows packed 8 to a group, the file's bytes moved
        from webchat.gguf.blocks import QTYPES

        kernels = model.tok_embeddings.kernels
        assert kernels is not None
        table = kernels.unpacked_rows(table, QTYPES[model.tok_embeddings.qtype][0], torch.arange(table.shape[0]))
    assert torch.equal(table, embed)  # the same bytes
    assert model.output.weight is model.tok_embeddings.weight  # tied (SmolLM2) and still one tensor


def test_moving_keeps_values_shapes_and_shared_parameters() -> None:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Embedding(300, 64), nn.Linear(64, 300, bias=True))
    net[1].weight = net[0].weight  # tied, as a model's head and embedding
    before = {name: p.detach().clone() for name, p in net.named_parameters()}
    moved = into_huge_pages(net)
    if not hasattr(mmap, "MADV_HUGEPAGE"):
        assert moved == 0
        return
    assert moved >= sum(t.numel() * t.element_size() for t in before.values())
    assert net[1].weight is net[0].weight
    for name, p in net.named_parameters():
        assert torch.equal(p.data, before[name]) and p.shape == before[name].shape
        assert p.data_ptr() % 64 == 0
    assert net[0].weight.data_ptr() % 4096 == 0  # a matrix starts on its own page
    x = torch.tensor([[1, 2, 3]])
    assert net(x).shape == (1, 3, 300)


def test_a_parameter_left_out_stays_where_it_was() -> None:
    net = nn.Sequential(nn.Embedding(300, 64), nn.Linear(64, 300))
    where = net[0].weight.data_ptr()
    into_huge_pages(net, leave=[net[0].weight])
    assert net[0].weight.data_ptr() == where  # an untied embedding is only gathered: its read rows alone resident
    if hasattr(mmap, "MADV_HUGEPAGE"):
        assert net[1].weight.data_ptr() != where and net[1].weight.data_ptr() % 4096 == 0


def test_file_pages_another_tensor_still_reads_are_kept_with_their_changes(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    save_file({"w": torch.arange(65536, dtype=torch.float32)}, str(tmp_path / "w.safetensors"))
    with safe_open(str(tmp_path / "w.safetensors"), framework="pt") as f:
        w = f.get_tensor("w")  # a view of the file's private, writable mapping
    w[20000] = -1.0  # changed in place: only this process's copy of the page holds it
    net = nn.Module()
    net.a = nn.Parameter(w[:32768], requires_grad=False)  # two parameters over the same bytes, 16 pages shared
    net.b = nn.Parameter(w[16384:], requires_grad=False)
    want_a, want_b = net.a.detach().clone(), net.b.detach().clone()
    into_huge_pages(net)
    assert torch.equal(net.a.data, want_a) and torch.equal(net.b.data, want_b)  # b's copy still sees the change
    assert net.b.data[20000 - 16384].item() == -1.0


@linux_thp
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.uint8])  # the pool's f32, f16 and q8_0 forms
def test_a_slot_major_kv_pool_is_made_on_huge_page_mappings_and_holds_what_is_written(dtype: torch.dtype) -> None:
    """The slot-major pool (the CUDA kernels' layout, emulated on the CPU) on huge pages."""
    from types import SimpleNamespace

    args = SimpleNamespace(n_layers=3, n_kv_heads=2, head_dim=64)
    pool = KVPool(args, 600, "cpu", dtype, head_major=False)  # type: ignore[arg-type]
    for whole, per_layer in ((pool._k, pool.k), (pool._v, pool.v)):
        assert whole.shape == (3, 600, 16, 2, 64) and whole.dtype == dtype and whole.is_contiguous()
        assert whole.data_ptr() % HUGE == 0  # from a 2 MiB boundary, so its first region can be a huge page
        start, end, flags = mapping_of(whole.data_ptr())
        assert " hg" in flags, flags
        assert whole.data_ptr() + whole.numel() * whole.element_size() <= end
        assert not per_layer[1][0].any()  # the padding page is zeroed
        assert [t.data_ptr() for t in per_layer] == [whole[i].data_ptr() for i in range(3)]
    pool.k[2][599] = 7  # the last page of the last layer: inside the mapping, read back as written
    pool.v[1][5, 3, 1] = 9
    assert (pool._k[2, 599] == 7).all() and (pool._v[1, 5, 3, 1] == 9).all() and not pool._v[1, 5, 2].any()


def _rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS in /proc/self/status")


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads the process's resident size from /proc")
@pytest.mark.parametrize("dtype", [torch.float32, torch.uint8])
def test_a_cpu_kv_pool_is_head_major_and_resident_as_it_is_written(dtype: torch.dtype) -> None:
    """The CPU's own pool: each head's slots one run in memory, on small pages: its first token in every layer makes a
    few 4 KiB pages resident, where a huge page a head's run would make 360 MiB of this (the default model's) shape."""
    from types import SimpleNamespace

    args = SimpleNamespace(n_layers=30, n_kv_heads=3, head_dim=64)
    before = _rss_mib()
    pool = KVPool(args, 1 + 8192 // 16, "cpu", dtype)  # type: ignore[arg-type]
    for layer in range(30):
        pool.k[layer][1, 0] = 1
        pool.v[layer][1, 0] = 1
    assert _rss_mib() - before < 48, "a fresh pool is resident as it is written, not a 2 MiB page a head"
    for whole, per_layer in ((pool._k, pool.k), (pool._v, pool.v)):
        row = whole.shape[-1]
        assert whole.shape == (30, 513, 16, 3, row) and whole.dtype == dtype
        assert whole.permute(0, 3, 1, 2, 4).is_contiguous()  # (layers, n_kv, pages, page_size, row) in memory
        assert not per_layer[0][0].any()  # the padding page is zeroed
    pool.k[29][512, 15, 2] = 7  # the last slot of the last head of the last layer: the tensor's last row
    assert pool.k[29][512, 15, 2].data_ptr() + pool.k[29][512, 15, 2].nbytes == pool._k.data_ptr() + pool._k.nbytes


def test_an_empty_tensor_on_huge_pages_has_its_shape_and_dtype() -> None:
    t = empty_on_huge_pages((5, 7, 3), torch.float16)
    assert t.shape == (5, 7, 3) and t.dtype == torch.float16 and t.is_contiguous()
    t.fill_(1.5)
    assert t.sum().item() == 1.5 * 105
    assert empty_on_huge_pages((0, 4), torch.float32).shape == (0, 4)  # nothing to map: torch.empty's


@pytest.mark.skipif(not hasattr(mmap, "MADV_HUGEPAGE"), reason="the mapping is Linux's")
def test_a_pool_larger_than_the_memory_is_an_error_naming_its_size(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise OSError(12, "Cannot allocate memory")

    monkeypatch.setattr(mmap, "mmap", refuse)  # as the kernel answers a mapping past RAM and swap
    with pytest.raises(RuntimeError, match=r"cannot map 4098 MiB of memory: Cannot allocate memory"):
        empty_on_huge_pages((1024, 1024, 1024), torch.float32)
