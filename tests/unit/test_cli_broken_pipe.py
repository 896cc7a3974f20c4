"""A command's output piped into a reader that stops early (``| head``) ends quietly."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from launch import cli

ROOT = Path(__file__).resolve().parents[2]


def test_output_into_a_closed_pipe_exits_141_without_a_traceback():
    read, write = os.pipe()
    os.close(read)  # the reader is gone before the command writes: every write is EPIPE
    try:
        proc = subprocess.run([sys.executable, "-m", "launch", "kvcalc", "--model", "mistralai/Mixtral-8x7B-v0.1",
                               "-tp", "4", "-ep", "4"], stdout=write, stderr=subprocess.PIPE, cwd=ROOT, text=True, timeout=120)
    finally:
        os.close(write)
    assert proc.returncode == cli.EXIT_BROKEN_PIPE, proc.stderr
    assert "Traceback" not in proc.stderr and "BrokenPipeError" not in proc.stderr, proc.stderr


def test_a_broken_connection_that_is_not_stdout_is_not_taken_for_a_closed_pipe(monkeypatch):
    # a command whose own socket broke: stdout is fine, so the error is not swallowed as `| head`
    def command(argv):
        raise BrokenPipeError(32, "Broken pipe")

    monkeypatch.setattr(cli, "load", lambda cmd: command)
    assert not cli.stdout_reader_gone()
    with pytest.raises(BrokenPipeError):
        cli.main(["kvcalc"])
