"""Review of the OpenAI request models against what OpenAI / vLLM accept: a nullable field sent as
``null`` takes its default (docs/server.md), inside ``stream_options`` too (vLLM types
``continuous_usage_stats`` as ``Optional[bool] = False``; clients that send every field send it null)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import httpx
import pytest

from launch.server import build_app
from tests.unit.server_fakes import FakeEngine, ServerThread


@pytest.fixture(scope="module")
def url():
    cfg = SimpleNamespace(api_key=None, served_model_name=None, max_queue_len=8, expert_distribution_dir=None)
    with ServerThread(build_app(FakeEngine(), cfg)) as srv:
        yield srv.base_url


def test_null_stream_options_fields_take_their_defaults(url) -> None:
    body = {"prompt": "ab", "max_tokens": 3, "stream": True,
            "stream_options": {"include_usage": None, "continuous_usage_stats": None}}
    r = httpx.post(url + "/v1/completions", json=body, timeout=10)
    assert r.status_code == 200, r.text
    events = [json.loads(ln[6:]) for ln in r.text.splitlines() if ln.startswith("data: {")]
    assert all(e["usage"] is None for e in events)  # neither usage option is on
    body["stream_options"] = {"include_usage": True, "continuous_usage_stats": None}
    events = [json.loads(ln[6:]) for ln in httpx.post(url + "/v1/completions", json=body, timeout=10).text.splitlines()
              if ln.startswith("data: {")]
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 3
    assert all(e["usage"] is None for e in events[:-1])
