"""``launch.serve.main`` on a Ctrl-C (SIGINT): while the engine is still being built (before uvicorn
has its signal handlers) and once serving, it exits the same way: status 0, the engine shut down
once, no traceback. In process, around the fake engine, with the signal raised in the main thread.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import httpx
import pytest

import launch.async_llm
import launch.serve
from launch.config import RuntimeConfig, ServerConfig
from parallel.groups import free_port
from tests.unit.server_fakes import FakeEngine


class CountingEngine(FakeEngine):
    engine = None  # what kv_pool_warning reads (patched out below)

    def __init__(self) -> None:
        super().__init__()
        self.shutdowns = 0

    async def shutdown(self) -> None:
        self.shutdowns += 1


def signal_when_serving(port: int, signum: int = signal.SIGINT) -> None:
    """Send this process ``signum`` once the server on ``port`` answers /health (within 10 s)."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            httpx.get(f"http://127.0.0.1:{port}/health", timeout=1)
            break
        except httpx.HTTPError:
            time.sleep(0.02)
    os.kill(os.getpid(), signum)


def serve_with_signal(when: str, signum: int, monkeypatch: pytest.MonkeyPatch,
                      capfd: pytest.CaptureFixture) -> tuple[list[CountingEngine], str]:
    """``launch.serve.main`` on a counting fake engine, sent ``signum`` while "building the engine"
    (from inside the build) or while "serving" (once /health answers); returns the engines built and
    the captured stdout + stderr, after checking main returned 0."""
    cfg = RuntimeConfig(model="fake-moe", server=ServerConfig(port=free_port()))
    engines: list[CountingEngine] = []

    def from_config(_cfg: RuntimeConfig) -> CountingEngine:
        engines.append(CountingEngine())
        if when == "building the engine":
            signal.raise_signal(signum)  # the build is synchronous: it goes on to the end
        else:
            threading.Thread(target=signal_when_serving, args=(cfg.server.port, signum), daemon=True).start()
        return engines[-1]

    monkeypatch.setattr(launch.async_llm.AsyncLLM, "from_config", staticmethod(from_config))
    monkeypatch.setattr(launch.serve, "config_from_args", lambda args: cfg)
    monkeypatch.setattr(launch.serve, "check_serve_config", lambda cfg: None)
    monkeypatch.setattr(launch.serve, "kv_pool_warning", lambda engine: None)
    assert launch.serve.main(["--log-level", "info"]) == 0
    out, err = capfd.readouterr()
    return engines, out + err


@pytest.mark.parametrize("when", ["building the engine", "serving"])
def test_ctrl_c_exits_quietly(when: str, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture) -> None:
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # asyncio.run's handler takes over
    engines, output = serve_with_signal(when, signal.SIGINT, monkeypatch, capfd)
    assert "Traceback" not in output and "CancelledError" not in output, output
    assert [e.shutdowns for e in engines] == [1]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
