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
