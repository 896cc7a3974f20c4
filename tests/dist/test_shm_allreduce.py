"""``parallel.shm_allreduce``: the tensor-parallel all-reduce of small CPU tensors through shared
memory gives gloo's sums (its bits for two ranks; the same bits on every rank for three), steps
aside for what it does not take, leaves no file behind, and a rank whose peer died raises instead
of waiting."""

from __future__ import annotations

import glob
import os
import time

import pytest
import torch
import torch.distributed as dist

from parallel.shm_allreduce import SHM_DIR, ShmAllReduce, shm_allreduce_wanted
from tests.dist.conftest import run_ranks

pytestmark = pytest.mark.skipif(not shm_allreduce_wanted(), reason="needs x86-64 Linux with /dev/shm")


def _sums(rank: int, world: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    shm = ShmAllReduce.for_group(dist.group.WORLD, capacity_bytes=64 * 1024)
    dist.barrier()  # rank 0 unlinks the file once every rank mapped it
    assert shm is not None and not glob.glob(os.path.join(SHM_DIR, "moe-allreduce-*"))
    out = []
    gen = torch.Generator().manual_seed(rank)
    for step, (shape, dtype) in enumerate([((4, 1024), torch.float32), ((1, 7), torch.bfloat16),
                                           ((3, 96), torch.float16), ((8, 2048), torch.float32),
                                           ((0, 16), torch.float32)] * 3):  # each buffer several times
        x = (torch.randn(shape, generator=gen) * (step + 1)).to(dtype)
        want = x.clone()
        dist.all_reduce(want)
        got = x.clone()
        assert shm.applies(got) and shm.all_reduce(got) is got
        out.append((got, want))
    gathered = shm.all_gather(torch.full((3, 5), float(rank)))  # between the all-reduces: one call sequence
    assert gathered.shape == (world, 3, 5) and all(bool((gathered[r] == r).all()) for r in range(world))
    big = torch.zeros(64 * 1024 // 4 + 1)
    assert not shm.applies(big) and not shm.applies(torch.zeros(4, 4, dtype=torch.int64))
    assert not shm.applies(torch.zeros(8, 8).t())  # not contiguous
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_sums_match_gloo_on_every_rank(world: int) -> None:
    results = run_ranks(_sums, world)
    for (got0, want0), *others in zip(*results):
        assert got0.shape == want0.shape and got0.dtype == want0.dtype
        for got, _ in others:
            assert torch.equal(got, got0)  # every rank the same bits
        if world == 2:
            assert torch.equal(got0, want0)  # a + b: gloo's bits
        else:
            torch.testing.assert_close(got0.float(), want0.float(), rtol=1e-2 if got0.dtype != torch.float32 else 1e-6,
                                       atol=1e-2 if got0.dtype != torch.float32 else 1e-5)


def _exchanges(rank: int, world: int) -> list:
    shm = ShmAllReduce.for_group(dist.group.WORLD, capacity_bytes=4096)
    gen = torch.Generator().manual_seed(10 + rank)
    out = []
    for step in range(6):
        counts = torch.randint(0, 4, (world,), generator=gen)
        counts[(rank + step) % world] = 0  # a pair with nothing to send
        if step == 4 and rank == world - 1:
            counts[0] = 200  # 200 rows of 40 bytes: past one rank's capacity, so nobody's rows move
        dtype = (torch.uint8, torch.float32, torch.bfloat16)[step % 3]
        send = (torch.arange(int(counts.sum()) * 10) + 1000 * rank).reshape(-1, 10).to(dtype)
        got, recv_counts = shm.all_to_all_v(send, counts.tolist())
        want_counts = torch.empty_like(counts)
        dist.all_to_all_single(want_counts, counts)
        assert recv_counts == want_counts.tolist()
        want = torch.empty((sum(recv_counts), 10), dtype=dtype)
        dist.all_to_all_single(want, send, recv_counts, counts.tolist())
        out.append((step, got, want))
    return out


def test_all_to_all_v_moves_gloos_rows_or_none_together() -> None:
    """Rows and counts as gloo's all_to_all_single moves them, for uint8 / fp32 / bf16 rows, empty
    pairs and one rank's rows past the capacity (then no rank gets rows, every rank the counts)."""
    for world in (2, 3):
        for rank_results in run_ranks(_exchanges, world):
            for step, got, want in rank_results:
                if step == 4:
                    assert got is None
                else:
                    assert got is not None and got.dtype == want.dtype and torch.equal(got, want), step


def _gathers(rank: int, world: int) -> list:
    shm = ShmAllReduce.for_group(dist.group.WORLD, capacity_bytes=1001)  # slots not a multiple of any dtype
    gen = torch.Generator().manual_seed(20 + rank)
    out = []
    for step, (dtype, width) in enumerate([(torch.uint8, 24), (torch.float32, 5), (torch.int64, 3),
                                           (torch.bfloat16, 7), (torch.float32, 5)]):
        rows = 0 if (rank + step) % 3 == 0 else 1 + rank + step  # some ranks send nothing
        if step == 4 and rank == 0:
            rows = 60  # 60 x 20 bytes: past rank 0's slot, so nobody's rows move
        send = (torch.randn(rows, width, generator=gen) * 100).to(dtype)
        got, sizes = shm.all_gather_v(send)
        want_sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
        dist.all_gather(want_sizes, torch.tensor([rows]))
        assert sizes == [int(n) for n in want_sizes]
        want = [torch.empty(n, width, dtype=dtype) for n in sizes]
        for r in range(world):  # gloo's all_gather wants equal sizes: one broadcast per rank
            if r == rank:
                want[r] = send.clone()
            dist.broadcast(want[r], src=r)
        out.append((step, got, torch.cat(want)))
    counts = torch.arange(5, dtype=torch.int64) * (rank + 1)  # the capacity count gather's dtype
    assert shm.fits(counts) and not shm.applies(counts)
    out.append(("int64", shm.all_gather(counts), torch.stack([torch.arange(5) * (r + 1) for r in range(world)])))
    partial = torch.randn(11, 6, generator=gen)  # [N, D] fp32: the allgather dispatcher's partial sums
    want = partial.clone()
    dist.all_reduce(want)
    first, stop = [(0, 4), (4, 4), (4, 11)][rank]
    out.append(("reduce_scatter", shm.reduce_scatter(partial, first, stop), want[first:stop]))
    return out


def test_all_gather_v_and_reduce_scatter_match_gloo() -> None:
    """all_gather_v: every rank's rows in rank order (empty ranks included; none where one rank's rows
    exceed its slot); all_gather of int64; reduce_scatter: each rank's rows of gloo's sum (its bits at
    two ranks). A capacity that is no multiple of the dtypes' sizes still lines every slot up."""
    for world in (2, 3):
        for rank_results in run_ranks(_gathers, world):
            for step, got, want in rank_results:
                if step == 4:
                    assert got is None
                    continue
                assert got is not None and got.dtype == want.dtype and got.shape == want.shape, step
                if step == "reduce_scatter" and world == 3:
                    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-5)
                else:
                    assert torch.equal(got, want), step


def _peer_dies(rank: int, world: int) -> str:
    shm = ShmAllReduce.for_group(dist.group.WORLD)
    assert shm is not None
    shm.all_reduce(torch.ones(4))
    if rank == 1:
        os._exit(0)  # gone without a word, as a killed worker
    start = time.monotonic()
    with pytest.raises(dist.DistError, match=r"peer process \d+ exited"):
        shm.all_reduce(torch.ones(4))
    assert time.monotonic() - start < 5
    return "raised"


def test_a_rank_whose_peer_died_raises() -> None:
    # rank 0's own check failing would be "rank0 failed"; passing, only rank 1's result is missing
    with pytest.raises(FileNotFoundError, match="rank1.pt"):
        run_ranks(_peer_dies, 2)


def _refused(rank: int, world: int) -> list[bool]:
    import socket

    import parallel.shm_allreduce as shm_mod

    answers = []
    real = os.posix_fallocate

    def full(fd: int, offset: int, size: int) -> None:
        raise OSError(28, "No space left on device")

    shm_mod.os.posix_fallocate = full  # /dev/shm full: rank 0 cannot make the segment
    answers.append(ShmAllReduce.for_group(dist.group.WORLD) is None)
    shm_mod.os.posix_fallocate = real
    hostname = socket.gethostname
    socket.gethostname = lambda: f"host{rank}"  # ranks on two hosts
    answers.append(ShmAllReduce.for_group(dist.group.WORLD) is None)
    socket.gethostname = hostname
    isfile = os.path.isfile
    if rank == 1:  # rank 1 sees another /dev/shm (a container's own) under the same host name
        shm_mod.os.path.isfile = lambda path: False
    answers.append(ShmAllReduce.for_group(dist.group.WORLD) is None)
    shm_mod.os.path.isfile = isfile
    answers.append(ShmAllReduce.for_group(dist.group.WORLD) is not None)  # and the group still works after
    dist.barrier()
    answers.append(not glob.glob(os.path.join(SHM_DIR, "moe-allreduce-*")))
    return answers


def test_every_rank_steps_aside_together_where_the_segment_cannot_be_made() -> None:
    """A full /dev/shm (on rank 0 only), ranks on two hosts, or a rank that does not see rank 0's file:
    None on every rank, no rank left waiting, no file left behind; gloo serves the collectives."""
    assert run_ranks(_refused, 2) == [[True] * 5] * 2


def test_not_wanted_when_switched_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MOE_SHM_ALLREDUCE", "0")
    assert not shm_allreduce_wanted()
