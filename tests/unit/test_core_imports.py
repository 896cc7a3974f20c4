"""ARCHITECTURE.md's dependency rules, checked on every import statement (AST, not runtime).

moe <- parallel <- launch, balancer <- launch: ``moe/`` imports only torch, safetensors,
numpy, the standard library and itself; ``balancer/`` only numpy, torch, the standard
library and itself; ``parallel/`` only moe, balancer, torch, numpy, safetensors, the standard
library and itself; only ``launch/`` imports ``ray``; ``launch/core/`` neither ``ray`` nor
``torch.distributed``, and torch only in the sampler (``sampler.py`` and the token history its
penalties read, ``token_history.py``).
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
STDLIB = set(sys.stdlib_module_names)
SAMPLER_FILES = {"sampler.py", "token_history.py"}  # launch/core's files that run on the worker's tensors


def imports_of(path: Path) -> list[tuple[int, str]]:
    """(line, absolute dotted module) for every import in the file, nested ones included.
    ``from pkg import mod`` also yields ``pkg.mod`` so ``from torch import distributed`` is seen."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = ".".join(path.relative_to(ROOT).with_suffix("").parts[:-1])
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.extend((node.lineno, a.name) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base_parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(p for p in [*base_parts, node.module or ""] if p)
            else:
                base = node.module or ""
            found.append((node.lineno, base))
            found.extend((node.lineno, f"{base}.{a.name}") for a in node.names if a.name != "*")
    return found


def files_under(package: str) -> list[Path]:
    files = sorted((ROOT / package).rglob("*.py"))
    assert files, f"no Python files under {package}/"
    return files


def top(module: str) -> str:
    return module.split(".")[0]


def violations(package: str, allowed_top: set[str]) -> list[str]:
    bad = []
    for path in files_under(package):
        for line, module in imports_of(path):
            if top(module) not in allowed_top | STDLIB:
                bad.append(f"{path.relative_to(ROOT)}:{line} imports {module}")
    return bad


def test_moe_imports_only_torch_safetensors_numpy():
    assert violations("moe", {"moe", "torch", "safetensors", "numpy"}) == []


def test_balancer_imports_only_numpy_and_torch():
    if not (ROOT / "balancer").exists():
        pytest.skip("no balancer/ package yet")
    assert violations("balancer", {"balancer", "numpy", "torch"}) == []


def test_parallel_imports_only_moe_balancer_and_torch():
    assert violations("parallel", {"parallel", "moe", "balancer", "torch", "numpy", "safetensors"}) == []


def test_only_launch_imports_ray():
    bad = [f"{path.relative_to(ROOT)}:{line} imports {module}"
           for package in ("moe", "parallel", "balancer") for path in files_under(package)
           for line, module in imports_of(path) if top(module) == "ray"]
    assert bad == []
    assert any(top(m) == "ray" for path in files_under("launch") for _, m in imports_of(path))


def core_violations() -> list[str]:
    bad = []
    for path in files_under("launch/core"):
        rel = path.relative_to(ROOT)
        for line, module in imports_of(path):
            if top(module) == "ray" or module == "torch.distributed" or module.startswith("torch.distributed."):
                bad.append(f"{rel}:{line} imports {module} (launch/core must stay free of ray/torch.distributed)")
            elif top(module) in {"torch", "numpy"} and path.name not in SAMPLER_FILES:
                bad.append(f"{rel}:{line} imports {top(module)} (only the sampler's {sorted(SAMPLER_FILES)} may)")
            elif module.startswith("launch") and not module.startswith("launch.core"):
                bad.append(f"{rel}:{line} imports {module} (the core must not depend on the launch shell)")
            elif top(module) not in STDLIB | {"launch", "torch", "numpy"}:
                bad.append(f"{rel}:{line} imports third-party {module}")
    return bad


def test_launch_core_is_pure():
    assert core_violations() == []


def test_the_checker_sees_forbidden_imports(tmp_path, monkeypatch):
    fake_root = tmp_path
    pkg = fake_root / "launch" / "core"
    pkg.mkdir(parents=True)
    (pkg / "bad.py").write_text(
        "from torch import distributed\n"
        "def f():\n    import ray\n"
        "from . import sampler\n"
    )
    monkeypatch.setattr(sys.modules[__name__], "ROOT", fake_root)
    found = [m for _, m in imports_of(pkg / "bad.py")]
    assert "torch.distributed" in found and "ray" in found and "launch.core.sampler" in found
    bad = core_violations()
    assert any("imports torch.distributed" in b for b in bad)
    assert any("bad.py:3 imports ray" in b for b in bad)
    assert not any("imports launch.core.sampler" in b for b in bad)
