"""Host tensors on huge-page mappings (moe/host_memory.py) and the packed weights that use them."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from moe import host_memory, kernels
from moe.host_memory import HUGE_PAGE_BYTES, anonymous_tensor, huge_page_bytes, is_anonymous, packed_tensor

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="anonymous mappings on Linux only")


@pytest.fixture(autouse=True)
def _huge_pages_on(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(host_memory.HUGE_PAGES_ENV, raising=False)


@linux_only
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.int8])
def test_anonymous_tensor_is_zeroed_aligned_and_writable(dtype: torch.dtype) -> None:
    t = anonymous_tensor((3, 1000, 7), dtype)
    assert t.shape == (3, 1000, 7) and t.dtype == dtype and t.is_contiguous()
    assert t.data_ptr() % HUGE_PAGE_BYTES == 0
    assert is_anonymous(t) and not is_anonymous(torch.zeros(3))
    assert torch.count_nonzero(t) == 0
    t[1, 2, 3] = 5
    assert t.sum().item() == 5


@linux_only
def test_a_view_keeps_the_mapping_alive() -> None:
    t = anonymous_tensor((1 << 20,), torch.float32)
    t.fill_(2.0)
    tail = t[-4:]
    del t
    assert tail.tolist() == [2.0] * 4


@linux_only
def test_anonymous_tensor_rejects_an_alignment_that_is_not_a_power_of_two() -> None:
    with pytest.raises(ValueError, match="power of two"):
        anonymous_tensor((4,), torch.float32, align=3 << 20)


@linux_only
def test_small_packed_tensors_share_a_chunk_without_overlapping() -> None:
    shapes = [(5, 3), (1, 1), (512, 1024), (7,), (33, 65)]
    pieces = [packed_tensor(s, torch.bfloat16) for s in shapes]
    for i, p in enumerate(pieces):
        assert p.shape == shapes[i] and p.dtype == torch.bfloat16 and p.is_contiguous()
        assert p.data_ptr() % host_memory.ARENA_ALIGN == 0
        assert torch.count_nonzero(p) == 0
        p.fill_(i + 1)
    for i, p in enumerate(pieces):  # no piece wrote over another
        assert torch.all(p == i + 1)
    spans = sorted((p.data_ptr(), p.data_ptr() + p.numel() * p.element_size()) for p in pieces)
    assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:], strict=False))


@linux_only
def test_a_large_packed_tensor_gets_its_own_aligned_mapping() -> None:
    big = packed_tensor((HUGE_PAGE_BYTES // 2 + 8,), torch.bfloat16)  # just over one huge page of bytes
    small = packed_tensor((8,), torch.bfloat16)
    assert big.data_ptr() % HUGE_PAGE_BYTES == 0
    assert big.untyped_storage().data_ptr() != small.untyped_storage().data_ptr()


@linux_only
def test_a_full_chunk_moves_the_arena_on() -> None:
    arena = host_memory._Arena(4096)
    a = arena.take((1000,), torch.float32, 4000)
    b = arena.take((100,), torch.float32, 400)  # 4032 + 400 > 4096: a new chunk
    assert a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr()
    c = arena.take((10,), torch.float32, 40)  # fits after b
    assert c.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
    assert c.data_ptr() == b.data_ptr() + 448


@linux_only
def test_packed_weights_live_on_huge_page_memory_and_unpack_to_the_originals() -> None:
    g = torch.Generator().manual_seed(0)
    w13 = torch.randn(4, 2 * 64, 256, generator=g).to(torch.bfloat16)  # P 4, I 64, D 256
    w2 = torch.randn(4, 256, 64, generator=g).to(torch.bfloat16)
    packed = kernels.pack_experts(w13, w2)
    assert packed.w13p.shape == (4, 8, 256, 16) and packed.w2p.shape == (4, 16, 64, 16)
    assert is_anonymous(packed.w13p) and is_anonymous(packed.w2p)
    gate_up = kernels.unpack_blocks(packed.w13p)  # [P, I/8, 16, D]: 8 gate rows then 8 up rows per block
    assert torch.equal(gate_up[:, :, :8].reshape(4, 64, 256), w13[:, :64])
    assert torch.equal(gate_up[:, :, 8:].reshape(4, 64, 256), w13[:, 64:])
    assert torch.equal(kernels.unpack_blocks(packed.w2p).reshape(4, 256, 64), w2)
    lin = kernels.pack_linear(torch.randn(40, 96, generator=g))  # C 40 -> 48 padded, fp32
    assert lin.wp.shape == (1, 3, 96, 16) and is_anonymous(lin.wp)


def _thp_setting() -> str | None:
    try:
        text = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return None
    return text[text.index("[") + 1 : text.index("]")] if "[" in text else None


@linux_only
def test_touched_mappings_get_huge_pages_where_the_system_gives_them() -> None:
    if _thp_setting() not in ("always", "madvise") or huge_page_bytes() is None:
        pytest.skip("transparent huge pages are off here")
    before = huge_page_bytes()
    t = anonymous_tensor((4 * HUGE_PAGE_BYTES,), torch.uint8)
    t.fill_(1)
    assert huge_page_bytes() - before >= HUGE_PAGE_BYTES


def test_huge_pages_can_be_switched_off_for_packed_weights(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(host_memory.HUGE_PAGES_ENV, "0")
    assert not host_memory.huge_pages_wanted()
    w = torch.randn(32, 64)
    lin = kernels.pack_linear(w)
    assert not is_anonymous(lin.wp) and not is_anonymous(packed_tensor((4,), torch.float32))
    assert torch.equal(kernels.unpack_blocks(lin.wp).reshape(32, 64), w)


def test_proc_bytes_reads_a_kb_field_and_says_none_otherwise(tmp_path: Path) -> None:
    f = tmp_path / "meminfo"
    f.write_text("MemTotal:       24000000 kB\nMemAvailable:   1000 kB\nBad: x kB\n")
    assert host_memory.proc_bytes(str(f), "MemAvailable") == 1000 * 1024
    assert host_memory.proc_bytes(str(f), "MemTotal") == 24000000 * 1024
    assert host_memory.proc_bytes(str(f), "Missing") is None
    assert host_memory.proc_bytes(str(f), "Bad") is None
    assert host_memory.proc_bytes(str(tmp_path / "absent"), "MemAvailable") is None
