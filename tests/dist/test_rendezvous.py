"""The rendezvous store listens on the address the ranks use (loopback here), not on every
interface as torch's own tcp:// / env:// stores do; the group it forms works."""

from __future__ import annotations

import datetime
import os

import psutil
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from parallel.groups import create_rendezvous_store, init_distributed, parse_init_method
from parallel.groups import free_port
from tests.dist.conftest import DIST_ENV


def listening(pid: int) -> list[tuple[str, int]]:
    """(address, port) of every TCP socket process ``pid`` listens on."""
    return [(c.laddr.ip, c.laddr.port) for c in psutil.Process(pid).net_connections(kind="inet")
            if c.status == psutil.CONN_LISTEN]


def _rank(rank: int, init_method: str, out) -> None:
    os.environ.update({k: v for k, v in DIST_ENV.items() if k != "MASTER_ADDR"})
    torch.set_num_threads(1)
    init_distributed(rank, 2, backend="gloo", init_method=init_method, timeout=30)
    t = torch.tensor([rank + 1])
    dist.all_reduce(t)
    out.put((rank, int(t), listening(os.getpid())))
    dist.barrier()  # rank 0's store outlives rank 1's last use of it
    dist.destroy_process_group()


@pytest.mark.slow
def test_store_listens_on_loopback_only_and_the_group_works():
    port = free_port()
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, f"tcp://127.0.0.1:{port}", out), daemon=True) for r in range(2)]
    for p in procs:
        p.start()
    try:
        results = dict((r, (s, socks)) for r, s, socks in (out.get(timeout=90) for _ in procs))
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.terminate()
    assert [p.exitcode for p in procs] == [0, 0]
    assert results[0][0] == results[1][0] == 3  # all_reduce of 1 + 2 over the new group
    rank0 = results[0][1]
    assert ("127.0.0.1", port) in rank0, rank0  # the store, on the address given
    wildcard = [s for r in results.values() for s in r[1] if s[0] in ("0.0.0.0", "::")]
    assert not wildcard, f"sockets on every interface: {wildcard}"


def test_store_binds_the_given_host():
    """Single process: the master store's socket is on 127.0.0.1 and serves a client."""
    port = free_port()
    timeout = datetime.timedelta(seconds=10)
    master = create_rendezvous_store("127.0.0.1", port, 0, 2, timeout)
    assert ("127.0.0.1", port) in listening(os.getpid())
    assert ("0.0.0.0", port) not in listening(os.getpid()) and ("::", port) not in listening(os.getpid())
    client = create_rendezvous_store("127.0.0.1", port, 1, 2, timeout)
    client.set("k", "v")
    assert master.get("k") == b"v"
    del client, master


def test_parse_init_method(monkeypatch):
    assert parse_init_method("tcp://127.0.0.1:2950") == ("127.0.0.1", 2950)
    assert parse_init_method("tcp://[::1]:2950") == ("::1", 2950)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "4000")
    assert parse_init_method(None) == parse_init_method("env://") == ("127.0.0.1", 4000)
    monkeypatch.delenv("MASTER_PORT")
    with pytest.raises(ValueError, match="needs MASTER_ADDR and MASTER_PORT"):
        parse_init_method(None)
    for bad in ("file:///tmp/x", "tcp://host", "tcp://:80"):
        with pytest.raises(ValueError, match="init_method must be"):
            parse_init_method(bad)


def test_rendezvous_host_is_loopback_on_one_machine():
    from launch.cluster import compute_rendezvous_host

    assert compute_rendezvous_host(["10.0.0.5"] * 4) == "127.0.0.1"
    assert compute_rendezvous_host(["10.0.0.5", "10.0.0.5", "10.0.0.6", "10.0.0.6"]) == "10.0.0.5"
    assert compute_rendezvous_host(["10.0.0.7", "10.0.0.5"]) == "10.0.0.7"  # rank 0's node
    with pytest.raises(ValueError):
        compute_rendezvous_host([])
