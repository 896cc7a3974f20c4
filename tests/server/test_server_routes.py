"""vLLM's small routes and its API-key rule, on ``build_app`` around the fake engine (in process, no
sockets): the key guards ``/v1`` only (and SGLang's expert-distribution routes), ``/version``,
``/ping`` and the ``/v1/models`` card with vLLM's fields.
"""

from __future__ import annotations

import importlib.metadata
from types import SimpleNamespace

import openai
import pytest
from fastapi.testclient import TestClient

from launch.server import app as app_module
from launch.server import build_app
from tests.unit.server_fakes import FakeEngine

KEY = "sekret"
GUARDED = [("GET", "/v1/models"), ("POST", "/v1/completions"), ("POST", "/v1/chat/completions"),
           ("GET", "/v1/no-such-route"), ("POST", "/start_expert_distribution_record"),
           ("POST", "/stop_expert_distribution_record"), ("POST", "/dump_expert_distribution_record")]
OPEN = [("GET", "/health", None), ("GET", "/ping", None), ("POST", "/ping", None), ("GET", "/version", None),
        ("GET", "/metrics", None), ("GET", "/openapi.json", None), ("POST", "/tokenize", {"prompt": "a"}),
        ("POST", "/detokenize", {"tokens": [33]})]


def server_config(**overrides):
    return SimpleNamespace(**{"api_key": None, "served_model_name": None, "max_queue_len": 8,
                              "expert_distribution_dir": None, **overrides})


@pytest.fixture
def engine() -> FakeEngine:
    return FakeEngine()


@pytest.fixture
def client(engine: FakeEngine) -> TestClient:
    return TestClient(build_app(engine, server_config(api_key=KEY)))


@pytest.mark.parametrize(("method", "path"), GUARDED)
def test_the_key_guards_v1_and_the_record_routes(client: TestClient, method: str, path: str) -> None:
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        r = client.request(method, path, headers=headers)
        assert r.status_code == 401, (headers, r.text)
        assert r.json()["error"]["type"] == "authentication_error"
    assert client.request(method, path, headers={"Authorization": f"Bearer {KEY}"}).status_code != 401


@pytest.mark.parametrize(("method", "path", "body"), OPEN)
def test_routes_outside_v1_are_open_as_vllms(client: TestClient, method: str, path: str, body: dict | None) -> None:
    r = client.request(method, path, json=body)
    assert r.status_code == 200, r.text


def test_options_and_unknown_routes_outside_v1_pass_the_key_check(client: TestClient) -> None:
    assert client.options("/v1/models").status_code == 405  # vLLM lets OPTIONS through (CORS preflight)
    assert client.get("/no-such-route").status_code == 404
    rejected = client.get("/metrics").text
    assert 'moe:requests_rejected_total{model_name="fake-moe",status="401"}' not in rejected


def test_the_key_rule_strips_the_root_path(engine: FakeEngine) -> None:
    client = TestClient(build_app(engine, server_config(api_key=KEY)), root_path="/api")
    assert client.get("/api/v1/models").status_code == 401
    assert client.get("/api/v1/models", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
    assert client.get("/api/metrics").status_code == 200


def test_version_is_the_installed_packages(client: TestClient, monkeypatch: pytest.MonkeyPatch) -> None:
    assert client.get("/version").json() == {"version": importlib.metadata.version("moe-serve")}

    def missing(name: str) -> str:
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(app_module.importlib.metadata, "version", missing)
    assert client.get("/version").json() == {"version": "unknown"}


def test_ping_answers_as_health(client: TestClient, engine: FakeEngine) -> None:
    for method in ("GET", "POST"):
        r = client.request(method, "/ping")
        assert (r.status_code, r.content) == (200, b"")
    engine.errored = True
    health = client.get("/health")
    assert health.status_code == 503
    for method in ("GET", "POST"):
        r = client.request(method, "/ping")
        assert (r.status_code, r.json()) == (503, health.json())


def test_models_card_has_vllms_fields(client: TestClient) -> None:
    r = client.get("/v1/models", headers={"Authorization": f"Bearer {KEY}"})
    (card,) = r.json()["data"]
    assert set(card) == {"id", "object", "created", "owned_by", "root", "parent", "max_model_len", "permission"}
    assert (card["id"], card["object"], card["owned_by"], card["root"], card["parent"], card["max_model_len"]) == \
        ("fake-moe", "model", "moe-serve", "fake-moe", None, 64)
    (perm,) = card["permission"]
    assert perm.pop("id").startswith("modelperm-") and isinstance(perm.pop("created"), int)
    assert perm == {"object": "model_permission", "allow_create_engine": False, "allow_sampling": True,
                    "allow_logprobs": True, "allow_search_indices": False, "allow_view": True,
                    "allow_fine_tuning": False, "organization": "*", "group": None, "is_blocking": False}


def test_openai_client_reads_the_model_list(client: TestClient) -> None:
    oai = openai.OpenAI(base_url=str(client.base_url) + "/v1", api_key=KEY, http_client=client, max_retries=0)
    (model,) = oai.models.list().data
    assert (model.id, model.owned_by) == ("fake-moe", "moe-serve")
