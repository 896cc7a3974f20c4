"""``python -m launch submit``: a command line with no job after ``--`` is a usage error found
before the cluster is asked anything."""

from __future__ import annotations

import pytest

from launch import submit


def test_empty_entrypoint_is_a_usage_error_before_probing(monkeypatch, capsys):
    def no_probe(*args, **kwargs):
        raise AssertionError("the dashboard was probed")

    monkeypatch.setattr(submit, "probe_auth", no_probe)
    monkeypatch.setattr(submit, "run_passing_output", no_probe)
    assert submit.main(["--address", "http://127.0.0.1:1", "--"]) == submit.EXIT_USAGE
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: no job command after `--`") and "\n" not in err


@pytest.mark.parametrize("argv", [["--", "python", "-c", "1"], ["--no-wait", "--", "--"]])
def test_an_entrypoint_is_passed_on(monkeypatch, argv):
    seen = []
    monkeypatch.setattr(submit, "probe_auth", lambda address, timeout_s=10.0: False)
    monkeypatch.setattr(submit, "run_passing_output", lambda cmd, env: (seen.append(cmd), (0, False))[1])
    assert submit.main(["--address", "http://127.0.0.1:1", *argv]) == 0
    assert seen[0][-len(argv):] == argv
