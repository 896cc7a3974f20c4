"""commbench: size parsing, nccl-tests arithmetic and table, and real runs on 2 gloo ranks."""

from __future__ import annotations

import json

import pytest
import torch

from parallel.bench.commbench import (
    OPS,
    Row,
    Timing,
    _write_json,
    bus_factor,
    compute_sizes,
    format_table,
    main,
    parse_size,
    run_collective,
)
from launch.bench.commbench import main as launch_commbench
from parallel.bench.dispatch import time_dispatch
from parallel.shm_allreduce import shm_allreduce_wanted
from tests.dist.conftest import run_ranks


def test_parse_size() -> None:
    assert parse_size("8") == 8
    assert parse_size("32M") == 32 * 2**20
    assert parse_size("1K") == parse_size("1kb") == 1024
    assert parse_size("2G") == 2 * 2**30
    with pytest.raises(ValueError, match="bad size '3X'"):
        parse_size("3X")


def test_bus_factors_match_nccl_tests() -> None:
    assert bus_factor("allreduce", 4) == pytest.approx(1.5)
    for op in ("alltoall", "allgather", "reducescatter"):
        assert bus_factor(op, 4) == pytest.approx(0.75)
    with pytest.raises(ValueError, match="unknown collective"):
        bus_factor("broadcast", 4)


def test_compute_sizes() -> None:
    assert compute_sizes("allreduce", 8, 64, 2, 4, 4) == [2, 4, 8, 16]
    # split ops: counts are multiples of the rank count, at least one element per rank
    assert compute_sizes("alltoall", 8, 128, 2, 4, 4) == [4, 8, 16, 32]
    with pytest.raises(ValueError, match="need -f >= 2, got 1"):
        compute_sizes("allreduce", 8, 64, 1, 4, 4)
    with pytest.raises(ValueError, match="need -e >= -b, got -b 1024 and -e 8 bytes"):
        compute_sizes("allreduce", 1024, 8, 2, 4, 4)
    with pytest.raises(ValueError, match="need -b >= 1 byte, got 0"):
        compute_sizes("allreduce", 0, 8, 2, 4, 4)


_BAD_SIZE = "bad size {!r}: expected an integer with an optional K, M or G suffix"


@pytest.mark.parametrize("argv,message", [
    ("allreduce -b 1K -e 8 -f 2 -np 2", "need -e >= -b, got -b 1024 and -e 8 bytes"),
    ("allreduce -f 1", "need -f >= 2, got 1"),
    ("allreduce -f 0", "need -f >= 2, got 0"),
    ("allreduce -f -2", "need -f >= 2, got -2"),
    ("allreduce -b 0", "need -b >= 1 byte, got 0"),
    ("allreduce -b -8", "-b: " + _BAD_SIZE.format("-8")),
    ("allreduce -b 8X", "-b: " + _BAD_SIZE.format("8X")),
    ("allreduce -b 1.5K", "-b: " + _BAD_SIZE.format("1.5K")),
    ("allreduce -e 8X", "-e: " + _BAD_SIZE.format("8X")),
    ("allreduce -np 0", "-np must be >= 1, got 0"),
    ("allreduce -n 0", "-n must be >= 1, got 0"),
    ("allreduce -w -1", "-w must be >= 0, got -1"),
    ("allreduce --threads -1", "--threads must be >= 0, got -1"),
    ("-np 2", "name a collective (alltoall, allreduce, allgather, reducescatter), or pass --dispatch / --moe-layer"),
    ("--moe-layer --ranks 1,3", "--ranks 1,3: give comma-separated rank counts, each >= 1 and dividing --experts 64"),
    ("--moe-layer --ranks x", "--ranks x: give comma-separated rank counts, each >= 1 and dividing --experts 64"),
    ("--dispatch --topk 20 --experts 8", "--topk 20 exceeds --experts 8 (each token picks distinct experts)"),
    ("--moe-layer --ranks 1 --topk 9 --experts 8", "--topk 9 exceeds --experts 8 (each token picks distinct experts)"),
    ("--dispatch --experts 6 -np 4",
     "--experts 6 must be divisible by -np 4 (each rank hosts the same number of experts)"),
    ("--dispatch --tokens 0", "--tokens must be >= 1, got 0"),
    ("--dispatch --transport shm", "--transport does not apply to --dispatch"),
    ("--dispatch --hidden -1", "--hidden must be >= 1, got -1"),
    ("--moe-layer --topk 0", "--topk must be >= 1, got 0"),
    ("--moe-layer --inter 0", "--inter must be >= 1, got 0"),
    ("--moe-layer --experts 0", "--experts must be >= 1, got 0"),
    ("--moe-layer --ranks 1 --experts 1 --topk 1",
     "--moe-layer needs --experts >= 2 (its DeepSeek-V3 router sums each group's top-2), got 1"),
])
def test_bad_flags_are_one_line_and_exit_2_before_any_rank_starts(argv, message, monkeypatch, capsys) -> None:
    def no_spawn(*args, **kwargs):
        raise AssertionError("a rank was spawned for bad flags")

    monkeypatch.setattr("parallel.bench.commbench.spawn", no_spawn)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # gloo ranks: no GPU count to check
    assert main(argv.split()) == 2
    captured = capsys.readouterr()
    assert captured.err == f"commbench: error: {message}\n" and captured.out == ""


@pytest.mark.parametrize("mode", ["allreduce", "--dispatch", "--moe-layer"])
def test_bad_output_file_is_one_line_before_any_rank_starts(mode, tmp_path, monkeypatch, capsys) -> None:
    def no_spawn(*args, **kwargs):
        raise AssertionError("a rank was spawned although -J cannot be written")

    monkeypatch.setattr("parallel.bench.commbench.spawn", no_spawn)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    (tmp_path / "afile").write_text("")
    for target, problem in ((tmp_path, f"{tmp_path} is a directory"),
                            (tmp_path / "afile" / "x.json", f"{tmp_path / 'afile'} is not a directory")):
        assert launch_commbench([mode, "-J", str(target)]) == 2
        captured = capsys.readouterr()
        assert captured.err == f"commbench: error: -J/--output_file: {problem}\n" and captured.out == ""


def test_a_write_that_fails_after_the_run_is_one_line(tmp_path, capsys) -> None:
    """A path the up-front check could not rule out (here a directory made after it) still ends
    in one line and exit 1, after the table was printed."""
    (tmp_path / "late").mkdir()
    assert _write_json(str(tmp_path / "late"), {"a": 1}) == 1
    assert capsys.readouterr().err == f"commbench: error: -J/--output_file: cannot write {tmp_path / 'late'}: is a directory\n"


def test_output_file_parents_are_made(tmp_path) -> None:
    out = tmp_path / "new" / "deeper" / "r.json"
    assert _write_json(str(out), {"a": 1}) == 0
    assert json.loads(out.read_text()) == {"a": 1}


def test_moe_layer_ranks_are_checked_against_gpus(monkeypatch, capsys) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr("parallel.bench.commbench.spawn", lambda *a, **k: pytest.fail("a rank was spawned"))
    assert main(["--moe-layer", "--ranks", "1,4"]) == 2
    assert capsys.readouterr().err == ("commbench: error: --ranks 1,4: 4 ranks exceed the 2 visible GPUs "
                                       "(one per rank)\n")


def test_more_ranks_than_gpus_is_one_line(monkeypatch, capsys) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert main(["allreduce", "-np", "2"]) == 2
    assert capsys.readouterr().err == "commbench: error: -np 2 exceeds the 1 visible GPUs (one per rank)\n"


def test_table_format() -> None:
    t = Timing(10.0, 2.0, 3.0, 0)
    table = format_table("allreduce", [Row(1024, 256, "float", "sum", -1, t, None)], 4, "gloo")
    lines = table.splitlines()
    assert "out-of-place" in lines[1] and "in-place" in lines[1]
    assert lines[2].split() == ["#", "size", "count", "type", "redop", "root", "time", "algbw", "busbw",
                                "#wrong", "time", "algbw", "busbw", "#wrong"]
    assert lines[4].split() == ["1024", "256", "float", "sum", "-1", "10.0", "2.00", "3.00", "0",
                                "N/A", "N/A", "N/A", "N/A"]
    assert lines[-1] == "# Avg bus bandwidth : 3.0000"


def _all_modes(rank: int, world: int) -> dict:
    rows = {op: run_collective(rank, world, op, [8, 64], "bfloat16", 1, 2, True) for op in OPS}
    if shm_allreduce_wanted():  # the two sizes through the segment, 4 MiB (2 a rank to gather) through gloo
        rows |= {f"{op}-shm": run_collective(rank, world, op, [8, 64, 1 << 20], "float", 1, 2, True, "shm")
                 for op in OPS}
    cfg = {"tokens": 16, "hidden": 8, "topk": 2, "experts": 4, "iters": 2, "warmup": 0}
    return {"rows": rows, "dispatch": time_dispatch(rank, world, cfg)}


@pytest.fixture(scope="module")
def rank0() -> dict:
    return run_ranks(_all_modes, 2)[0]


@pytest.mark.parametrize("op", OPS)
def test_collective_on_two_ranks(op: str, rank0: dict) -> None:
    rows = rank0["rows"][op]
    assert [(r.count, r.size) for r in rows] == [(8, 16), (64, 128)]
    for row in rows:
        assert row.out_of_place.wrong == 0 and row.out_of_place.time_us > 0
        assert row.out_of_place.busbw == pytest.approx(row.out_of_place.algbw * bus_factor(op, 2))
        assert (row.in_place is None) == (op == "alltoall")
        if row.in_place is not None:
            assert row.in_place.wrong == 0


@pytest.mark.skipif(not shm_allreduce_wanted(), reason="needs x86-64 Linux with /dev/shm")
@pytest.mark.parametrize("op", OPS)
def test_collective_through_shared_memory_on_two_ranks(op: str, rank0: dict) -> None:
    """--transport shm: the sizes that fit the segment go through it (in place only for the all-reduce,
    the one it does in place), the larger one through gloo; every result checked."""
    rows = rank0["rows"][f"{op}-shm"]
    assert [(r.size, r.transport) for r in rows] == [(32, "shm"), (256, "shm"), (1 << 22, "gloo")]
    for row in rows:
        assert row.out_of_place.wrong == 0 and row.out_of_place.time_us > 0
        assert (row.in_place is None) == (op == "alltoall" or (op != "allreduce" and row.transport == "shm"))
        assert row.in_place is None or row.in_place.wrong == 0
    table = format_table(op, rows, 2, "gloo")
    assert "# Through shared memory: sizes 32-256 B; 1 larger size(s) through gloo" in table


def test_shm_transport_where_the_runtime_has_none_is_one_line(monkeypatch, capsys) -> None:
    monkeypatch.setattr("parallel.bench.commbench.shm_allreduce_wanted", lambda: False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["allreduce", "-np", "2", "--transport", "shm"]) == 2
    assert capsys.readouterr().err == (
        "commbench: error: --transport shm needs gloo ranks on x86-64 Linux with /dev/shm and MOE_SHM_ALLREDUCE "
        "not 0 (the runtime's shared-memory collectives)\n")


def test_dispatch_bench_on_two_ranks(rank0: dict) -> None:
    res = rank0["dispatch"]
    assert len(res["pairs"]) == 2 and all(len(p) == 3 and min(p) > 0 for p in res["pairs"])
    assert res["verified"]  # identity experts: each token came back once per rank it visited
    assert 0 < res["rows_sent"] <= 16 * 2  # at most one row per (token, rank)


def test_cli_end_to_end(tmp_path, capsys) -> None:
    out = tmp_path / "r.json"
    rc = main(["reducescatter", "-b", "64", "-e", "1K", "-f", "4", "-n", "2", "-w", "1", "-np", "2", "-c", "1",
               "-d", "bfloat16", "-J", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "# Out of bounds values : 0 OK" in text and "# Avg bus bandwidth : " in text
    data = json.loads(out.read_text())
    assert data["op"] == "reducescatter" and data["nranks"] == 2
    assert [r["size"] for r in data["rows"]] == [64, 256, 1024]
    assert data["avg_busbw"] > 0
