"""Guarantees that already held and must keep holding: nothing is ever unpickled, the dump
directory is fixed at startup, the server binds loopback by default."""

from __future__ import annotations

import ast
from pathlib import Path
from types import SimpleNamespace

import httpx

from launch.config import ServerConfig
from launch.server import build_app
from tests.unit.server_fakes import FakeEngine, ServerThread

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("launch", "moe", "parallel", "balancer")


def unpickling_calls(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, call) for every call that can unpickle: pickle/cloudpickle/dill load(s) and
    Unpickler, torch.load without weights_only=True, numpy load with allow_pickle=True."""
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
            continue
        owner = node.func.value.id if isinstance(node.func.value, ast.Name) else ""
        name = node.func.attr
        kwargs = {k.arg: k.value for k in node.keywords}
        literal = {k: v.value for k, v in kwargs.items() if isinstance(v, ast.Constant)}
        if owner in ("pickle", "cloudpickle", "dill", "_pickle") and name in ("load", "loads", "Unpickler"):
            found.append((node.lineno, f"{owner}.{name}"))
        elif owner == "torch" and name == "load" and literal.get("weights_only") is not True:
            found.append((node.lineno, "torch.load without weights_only=True"))
        elif owner in ("np", "numpy") and name == "load" and literal.get("allow_pickle", False) is not False:
            found.append((node.lineno, "numpy.load with allow_pickle"))
    return found


def test_nothing_is_ever_unpickled():
    offenders = []
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            for line, call in unpickling_calls(ast.parse(path.read_text(), str(path))):
                offenders.append(f"{path.relative_to(REPO)}:{line}: {call}")
    assert not offenders, offenders


def test_the_checker_sees_unpickling():
    src = ("import pickle, torch, numpy as np\npickle.loads(b'')\ntorch.load('x')\n"
           "torch.load('x', weights_only=True)\nnp.load('x', allow_pickle=True)\nnp.load('x')\n")
    assert [line for line, _ in unpickling_calls(ast.parse(src))] == [2, 3, 5]


def test_dump_directory_is_fixed_at_startup(tmp_path):
    """Whatever a request sends (body, query), dumps land in the configured directory."""
    fixed = tmp_path / "fixed"
    cfg = SimpleNamespace(api_key=None, served_model_name=None, max_queue_len=8, expert_distribution_dir=str(fixed))
    with ServerThread(build_app(FakeEngine(), cfg)) as srv:
        url = srv.base_url + "/dump_expert_distribution_record"
        evil = tmp_path / "elsewhere"
        for r in (httpx.post(url, json={"directory": str(evil), "path": str(evil)}, timeout=10),
                  httpx.post(url, params={"directory": str(evil), "dir": str(evil)}, timeout=10)):
            assert r.status_code == 200, r.text
            assert Path(r.json()["path"]).parent == fixed
    assert not evil.exists() and len(list(fixed.glob("expert_distribution_*.safetensors"))) == 2


def test_default_bind_is_loopback():
    assert ServerConfig().host == "127.0.0.1"
