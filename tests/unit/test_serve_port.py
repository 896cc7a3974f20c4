"""``serve --port 0``: the "serving ... on http://HOST:PORT" line names the port the system gave, once
uvicorn listens (it said port 0 before, and before the server listened)."""

from __future__ import annotations

import asyncio
import threading
import time
from types import SimpleNamespace

import httpx
import uvicorn
from starlette.applications import Starlette
from starlette.responses import PlainTextResponse
from starlette.routing import Route

from launch.serve import _DrainingServer


def test_the_listening_port_is_reported_after_startup():
    app = Starlette(routes=[Route("/", lambda request: PlainTextResponse("ok"))])
    seen: list[int] = []
    server = _DrainingServer(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"), SimpleNamespace(),
                             on_listening=seen.append)
    thread = threading.Thread(target=lambda: asyncio.run(server.serve()), daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not seen and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(seen) == 1 and seen[0] > 0
        assert httpx.get(f"http://127.0.0.1:{seen[0]}/", timeout=5).text == "ok"  # it listens there already
    finally:
        server.should_exit = True
        thread.join(30)
