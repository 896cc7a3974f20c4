"""bench serve: a NaN request rate or an infinite / NaN burstiness would give NaN arrival intervals
(every request sent at once, the result still naming the rate); they, and a NaN goodput SLO (no
request ever good), are one-line errors before the server is asked anything."""

from __future__ import annotations

import pytest

from launch.bench import serve as bench_serve
from launch.bench.serve import arrival_intervals, parse_goodput


@pytest.mark.parametrize(("rate", "burstiness", "flag"), [(float("nan"), 1.0, "--request-rate"),
                                                          (2.0, float("inf"), "--burstiness"),
                                                          (2.0, float("nan"), "--burstiness")])
def test_arrival_intervals_refuse_nan_producing_flags(rate, burstiness, flag) -> None:
    with pytest.raises(ValueError, match=f"^{flag} must be"):
        arrival_intervals(3, rate, burstiness, 0)


def test_a_nan_goodput_slo_is_refused() -> None:
    with pytest.raises(ValueError, match="--goodput value for ttft must be >= 0, got nan"):
        parse_goodput(["ttft:nan"])


@pytest.mark.parametrize(("flags", "line"), [
    (["--request-rate", "nan"], "error: --request-rate must be > 0 (inf: all at once), got nan"),
    (["--burstiness", "inf"], "error: --burstiness must be a finite number > 0, got inf"),
    (["--request-rate", "0"], "error: --request-rate must be > 0 (inf: all at once), got 0.0"),
])
def test_bad_arrival_flags_are_named_before_the_server_is_asked(flags, line, monkeypatch, capsys) -> None:
    async def no_server(args):
        raise AssertionError("the server was asked")

    monkeypatch.setattr(bench_serve, "resolve_target", no_server)
    assert bench_serve.main(["--port", "9", "--vocab-size", "10", "--num-prompts", "1", *flags]) == 2
    assert capsys.readouterr().err == line + "\n"
