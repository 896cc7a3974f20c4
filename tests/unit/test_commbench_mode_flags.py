"""commbench refuses a flag its chosen mode would ignore, before any rank starts."""

from __future__ import annotations

import pytest

from parallel.bench.commbench import build_parser, main, mode_flag_problem


@pytest.mark.parametrize(("argv", "message"), [
    (["allreduce", "--dispatch"], "--dispatch times no collective: drop 'allreduce'"),
    (["--dispatch", "--moe-layer"], "--dispatch and --moe-layer are two benchmarks"),
    (["--dispatch", "-b", "1K", "-e", "2K"], "-b, -e do not apply to --dispatch"),
    (["--dispatch", "--ranks", "1,2"], "--ranks does not apply to --dispatch"),
    (["--moe-layer", "-np", "2"], "-np does not apply to --moe-layer"),
    (["--moe-layer", "-d", "half"], "-d does not apply to --moe-layer"),
    (["allreduce", "--tokens", "5"], "--tokens does not apply to a collective"),
    (["alltoall", "--backend", "allgather", "--inter", "64"], "--backend, --inter do not apply to a collective"),
])
def test_a_flag_the_mode_would_ignore_is_one_line(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err


def test_unset_flags_take_their_defaults_and_given_ones_stay():
    args = build_parser().parse_args(["allreduce", "-e", "1K"])
    assert mode_flag_problem(args) is None
    assert (args.minbytes, args.maxbytes, args.stepfactor, args.datatype, args.check, args.nprocs) == \
        ("8", "1K", 2, "float", 1, 4)
    args = build_parser().parse_args(["--moe-layer", "--inter", "64"])
    assert mode_flag_problem(args) is None
    assert (args.inter, args.ranks, args.tokens, args.experts, args.backend) == (64, "1,2,4", 2048, 64, "alltoall")


@pytest.mark.parametrize(("argv", "message"), [
    (["allreduce", "-np", "2", "-n", "1", "-w", "0", "-b", "100G", "-e", "100G"],
     "-e 100G: input and output of 107,374,182,400 bytes on each of -np 2 ranks need at least 400.0 GiB"),
    (["--dispatch", "--tokens", "100000000", "-np", "2"], "--tokens 100000000 x --hidden"),
    (["--moe-layer", "--tokens", "10000000", "--ranks", "1"], "bf16 rows on 1 rank(s) need at least"),
])
def test_sizes_past_the_memory_are_one_line_before_any_rank(argv, message, capsys, monkeypatch):
    """A size the ranks cannot allocate is refused up front (MemAvailable), not as each rank's
    allocator traceback."""
    import moe.kv_cache

    monkeypatch.setattr(moe.kv_cache, "available_memory_bytes", lambda: 16 * 2**30)
    assert main(argv) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("commbench: error: ") and message in line and "16.0 GiB available" in line


def test_memory_check_passes_what_fits_and_skips_without_meminfo(monkeypatch):
    import moe.kv_cache
    from parallel.bench.commbench import memory_problem

    args = build_parser().parse_args(["allreduce", "-np", "2", "-e", "1M"])
    assert memory_problem(args, 2**20, available=2**30) is None
    assert "need at least 4.0 GiB" in memory_problem(args, 2**30, available=2**30)
    monkeypatch.setattr(moe.kv_cache, "available_memory_bytes", lambda: None)  # not Linux: no figure, no check
    assert memory_problem(args, 2**40) is None


@pytest.mark.parametrize(("argv", "message"), [
    (["-np", "abc", "allreduce"], "argument -np/--nprocs: invalid int value: 'abc'"),
    (["bogus"], "argument op: invalid choice: 'bogus'"),
])
def test_argparse_errors_are_one_line_too(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"commbench: error: {message}") and "usage:" not in line
