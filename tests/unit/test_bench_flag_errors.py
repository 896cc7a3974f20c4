"""Each bench names the one flag that is out of range (or repeated), with its value, before any work."""

from __future__ import annotations

import pytest

from launch.cli import main

CASES = [
    (["bench", "decode", "--model", "x", "--warmup-steps", "-1"], "--warmup-steps must be >= 0, got -1"),
    (["bench", "decode", "--model", "x", "--num-threads", "0"], "--num-threads must be >= 1, got 0"),
    (["bench", "overhead", "--model", "x", "--warmup-steps", "-2"], "--warmup-steps must be >= 0, got -2"),
    (["bench", "overhead", "--model", "x", "--num-threads", "0"], "--num-threads must be >= 1, got 0"),
    (["bench", "moe-layer", "--tokens", "4", "0"], "--tokens must be >= 1, got 0"),
    (["bench", "moe-layer", "--num-threads", "0"], "--num-threads must be >= 1, got 0"),
    (["bench", "moe-layer", "--min-seconds", "nan"], "--min-seconds must be >= 0, got nan"),
    (["bench", "moe-layer", "--impls", "ours", "transformers", "ours"],
     "--impls names an implementation twice: ours transformers ours"),
    (["bench", "eplb", "--drift", "-1"], "--drift must be >= 0, got -1.0"),
    (["bench", "eplb", "--repeats", "0"], "--repeats must be >= 1, got 0"),
    (["bench", "eplb", "--series", "--check-interval", "0"], "--check-interval must be positive, got 0"),
    (["bench", "eplb", "--series", "--full-interval", "-3"], "--full-interval must be positive, got -3"),
]


@pytest.mark.parametrize(("argv", "message"), CASES, ids=[" ".join(c[0][1:]) for c in CASES])
def test_an_out_of_range_flag_is_named_alone_with_its_value(capsys, argv: list[str], message: str) -> None:
    try:
        rc = main(argv)
    except SystemExit as exit_:  # the parser's error (launch.config_args.FlagParser: one line)
        rc = exit_.code
    err = capsys.readouterr().err
    assert rc == 2
    (line,) = err.strip().splitlines()  # one line, no usage block
    assert line.startswith(f"error: {message}"), err
    assert "Traceback" not in err
