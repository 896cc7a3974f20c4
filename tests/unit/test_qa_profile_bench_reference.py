"""QA of ``bench eplb --reference``: a reference file that fails or answers something other than
DeepSeek's phy2log is one line naming ``--reference``, a reference that moves nothing gets no
"share of copies moved", a conforming reference still runs; a negative ``--seed`` is one line."""

from __future__ import annotations

import pytest

from launch.bench import eplb


def _run(tmp_path, capsys, body: str) -> tuple[int, str, str]:
    (tmp_path / "eplb.py").write_text(body)
    try:
        rc = eplb.main(["--reference", str(tmp_path), "--scenario", "mixtral-ep8", "--load", "zipf"])
    except SystemExit as e:
        rc = e.code
    out = capsys.readouterr()
    return rc, out.out, out.err


@pytest.mark.parametrize("body,problem", [
    ("def rebalance_experts(*args):\n    raise RuntimeError('boom')\n",
     "rebalance_experts failed: RuntimeError: boom"),
    ("def rebalance_experts(*args):\n    return 5\n", "rebalance_experts did not return DeepSeek's"),
    ("import torch\ndef rebalance_experts(w, p, *args):\n"
     "    return torch.zeros(w.shape[0], p, dtype=torch.int64), None, None\n",  # expert 1.. never placed
     "rebalance_experts did not return DeepSeek's (phy2log [32, 16] of every expert id in [0, 8)"),
    ("import torch\ndef rebalance_experts(w, p, *args):\n"
     "    return torch.full((w.shape[0], p), 8), None, None\n", "did not return DeepSeek's"),  # id out of range
    ("def rebalance_experts(w, p, *args):\n    return [[0, 1], [2]], None, None\n", "did not return DeepSeek's"),
])
def test_a_reference_that_fails_or_answers_wrong_is_one_line(tmp_path, capsys, body, problem):
    rc, _, err = _run(tmp_path, capsys, body)
    (line,) = err.strip().splitlines()  # one line, no usage block
    assert rc == 2 and "Traceback" not in err
    assert line.startswith(f"error: --reference {tmp_path}: ") and problem in line


def test_a_conforming_reference_runs_and_a_reference_that_moves_nothing_has_no_share(tmp_path, capsys):
    # A valid static placement (slot p holds expert p % E): never moves a copy under drift.
    body = ("import torch\ndef rebalance_experts(w, p, *args):\n"
            "    phy = (torch.arange(p) % w.shape[1]).repeat(w.shape[0], 1)\n"
            "    return phy, None, None\n")
    rc, out, err = _run(tmp_path, capsys, body)
    assert rc == 0, err
    last = out.strip().splitlines()[-1]
    assert "vs reference 0" in last and "%" not in last


@pytest.mark.parametrize("argv", [
    ["--scenario", "mixtral-ep8", "--load", "zipf", "--seed", "-1"],
    ["--series", "--kind", "steady", "--seed", "2", "--seed", "-1"],
])
def test_a_negative_seed_is_one_line_before_running(argv, capsys, monkeypatch):
    import launch.bench.eplb_series

    monkeypatch.setattr(eplb, "run_case", lambda *a, **k: pytest.fail("the benchmark ran"))
    monkeypatch.setattr(launch.bench.eplb_series, "run_trace", lambda *a, **k: pytest.fail("the series ran"))
    with pytest.raises(SystemExit) as exit_:
        eplb.main(argv)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "Traceback" not in err
    (line,) = err.strip().splitlines()  # one line, no usage block
    assert line.startswith("error: --seed must be >= 0, got -1 ")
