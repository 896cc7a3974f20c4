"""The server with several served names, as vLLM's (``entrypoints/openai/serving_models.py`` and
``serving_engine.py``): requests may name any of them, ``/v1/models`` lists each with ``root`` the
model path, a reply's ``model`` is the request's (the first name when it names none), and the
metrics' ``model_name`` label is the first name."""

from __future__ import annotations

import json
from collections.abc import Iterator
from types import SimpleNamespace

import httpx
import pytest

from launch.config import ServerConfig
from launch.server import build_app
from tests.unit.server_fakes import FakeEngine, ServerThread

MODEL_PATH = "/checkpoints/tiny-dsv3"


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SimpleNamespace]:
    engine = FakeEngine()
    engine.model_name = "primary"  # AsyncLLM's: the first served name
    engine.model_path = MODEL_PATH
    cfg = ServerConfig(served_model_name=["primary", "alias"], max_queue_len=8,
                       expert_distribution_dir=str(tmp_path_factory.mktemp("dist")))
    with ServerThread(build_app(engine, cfg)) as srv:
        yield SimpleNamespace(url=srv.base_url)


def _post(served: SimpleNamespace, path: str, body: dict) -> httpx.Response:
    return httpx.post(served.url + path, json=body, timeout=10)


def test_models_lists_every_name_with_the_model_path_as_root(served: SimpleNamespace) -> None:
    cards = httpx.get(served.url + "/v1/models").json()["data"]
    assert [(c["id"], c["root"], c["max_model_len"]) for c in cards] == [("primary", MODEL_PATH, 64),
                                                                         ("alias", MODEL_PATH, 64)]


@pytest.mark.parametrize("model,expected", [("primary", "primary"), ("alias", "alias"), (None, "primary"),
                                            ("", "primary")])  # vLLM: an empty model is no model
def test_any_name_is_served_and_the_reply_names_the_requests_model(served: SimpleNamespace, model: str | None,
                                                                    expected: str) -> None:
    named = {} if model is None else {"model": model}
    body = {"prompt": [5, 6], "max_tokens": 2} | named
    r = _post(served, "/v1/completions", body)
    assert r.status_code == 200 and r.json()["model"] == expected, r.text
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2} | named
    r = _post(served, "/v1/chat/completions", chat)
    assert r.status_code == 200 and r.json()["model"] == expected, r.text


def test_streamed_chunks_name_the_requests_model(served: SimpleNamespace) -> None:
    body = {"model": "alias", "prompt": [5, 6], "max_tokens": 3, "stream": True,
            "stream_options": {"include_usage": True}}
    r = _post(served, "/v1/completions", body)
    events = [line[len("data: "):] for line in r.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and len(events) > 2
    assert {json.loads(e)["model"] for e in events[:-1]} == {"alias"}


@pytest.mark.parametrize("model", ["other", MODEL_PATH, "PRIMARY"])
def test_an_unlisted_name_gets_404_listing_the_served_names(served: SimpleNamespace, model: str) -> None:
    r = _post(served, "/v1/completions", {"model": model, "prompt": [5], "max_tokens": 1})
    assert r.status_code == 404, r.text
    error = r.json()["error"]
    assert error["message"] == f"The model `{model}` does not exist; this server serves `primary`, `alias`."
    assert (error["type"], error["param"]) == ("not_found_error", "model")


def test_metrics_are_labelled_with_the_first_name(served: SimpleNamespace) -> None:
    _post(served, "/v1/completions", {"model": "alias", "prompt": [5], "max_tokens": 1})
    text = httpx.get(served.url + "/metrics").text
    assert 'vllm:num_requests_running{model_name="primary"}' in text and 'model_name="alias"' not in text


def test_one_name_lists_the_model_path_as_root_too() -> None:
    engine = FakeEngine()
    engine.model_path = MODEL_PATH
    with ServerThread(build_app(engine, ServerConfig(served_model_name="tiny"))) as srv:
        cards = httpx.get(srv.base_url + "/v1/models").json()["data"]
    assert [(c["id"], c["root"]) for c in cards] == [("tiny", MODEL_PATH)]
