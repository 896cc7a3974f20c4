"""SIGTERM: a command unwinds as for a Ctrl-C (its cleanup runs) and exits 143 with one line, even
where Ray's waits turn the handler's exception into a KeyboardInterrupt; ``ray.init`` keeps a
handler the process had (serve's, the CLI's) and holds a SIGTERM that lands inside it."""

from __future__ import annotations

import os
import signal
import sys
import types

import pytest

from launch import cli
from launch.cluster import _sigterm_handler_kept


def _command(monkeypatch: pytest.MonkeyPatch, name: str, fn) -> None:
    module = types.ModuleType(f"fake_{name}")
    module.main = fn
    monkeypatch.setitem(sys.modules, module.__name__, module)
    monkeypatch.setitem(cli.COMMANDS, name, cli.Command(name, f"{module.__name__}:main", "x"))


def test_sigterm_unwinds_the_command_and_exits_143(monkeypatch, capsys) -> None:
    cleaned = []

    def run(argv):
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            signal.sigtimedwait([], 0)  # a bytecode boundary for the handler (it runs at once anyway)
            raise AssertionError("the SIGTERM did not stop the command")
        finally:
            cleaned.append(True)

    before = signal.getsignal(signal.SIGTERM)
    _command(monkeypatch, "term", run)
    assert cli.main(["term"]) == cli.EXIT_TERMINATED == 143
    assert cleaned == [True] and capsys.readouterr().err.strip() == "terminated"
    assert signal.getsignal(signal.SIGTERM) is before


def test_a_sigterm_that_ray_turned_into_keyboardinterrupt_still_exits_143(monkeypatch, capsys) -> None:
    def run(argv):
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            signal.sigtimedwait([], 0)
        except cli.Terminated:
            raise KeyboardInterrupt from None  # what ray.wait's check_status raises for it

    _command(monkeypatch, "ray-term", run)
    assert cli.main(["ray-term"]) == 143
    assert capsys.readouterr().err.strip() == "terminated"

    def interrupt(argv):
        raise KeyboardInterrupt

    _command(monkeypatch, "int", interrupt)  # a Ctrl-C after it is a Ctrl-C again
    assert cli.main(["int"]) == cli.EXIT_INTERRUPTED
    assert capsys.readouterr().err.strip() == "interrupted"


def test_ray_init_keeps_a_handler_and_holds_a_sigterm_inside_it() -> None:
    import ray._private.utils as ray_utils

    seen = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: seen.append(signum))
    try:
        with _sigterm_handler_kept():
            ray_utils.set_sigterm_handler(lambda signum, frame: sys.exit(signum))  # what ray.init does first
            os.kill(os.getpid(), signal.SIGTERM)
            signal.sigtimedwait([], 0)
            assert seen == []  # held: ray.init cut short would leave its agents running
        assert seen == [signal.SIGTERM]  # delivered to the process's own handler once the block ends
        os.kill(os.getpid(), signal.SIGTERM)
        signal.sigtimedwait([], 0)
        assert seen == [signal.SIGTERM] * 2  # and it stays in force
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_ray_init_installs_its_own_handler_where_there_was_none() -> None:
    import ray._private.utils as ray_utils

    ray_handler = lambda signum, frame: None  # noqa: E731
    previous = signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        with _sigterm_handler_kept():
            ray_utils.set_sigterm_handler(ray_handler)
        assert signal.getsignal(signal.SIGTERM) is ray_handler
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_an_engine_stopped_by_worker_faults_is_one_line_and_exit_1() -> None:
    """After recovery.max_restarts the engine stops for good: its reason, not an 80-line chained
    traceback through Ray's actor error."""
    from launch.recovery import EngineDeadError, WorkerFault

    reason = ("worker rank 1 (pid 7) died (its process exited); 2 worker faults within 600s "
              "(recovery.max_restarts=1): engine stopped")
    assert cli._user_error(EngineDeadError(reason)) == (reason, cli.EXIT_FAILED)
    assert cli._user_error(WorkerFault("worker rank 0 hung", rank=0)) == ("worker rank 0 hung", cli.EXIT_FAILED)
