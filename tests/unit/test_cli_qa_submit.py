"""``python -m launch submit`` hands Ray's ``ray job submit`` the address it checked: Ray 2.60's CLI
lets RAY_ADDRESS / RAY_API_SERVER_ADDRESS override ``--address`` and reads a bare HOST:PORT as a GCS
address, so without that the probe and the submission could reach different places."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from launch import submit
from tests.unit.test_submit import Dashboard


@pytest.fixture
def fake_ray(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """``ray`` replaced by a script that records its arguments and the address variables it got."""
    record = tmp_path / "ray_call.json"
    script = tmp_path / "fake_ray.py"
    script.write_text("import json, os, sys\n"
                      f"open({str(record)!r}, 'w').write(json.dumps({{'argv': sys.argv[1:], 'env': "
                      "{k: os.environ.get(k) for k in ('RAY_ADDRESS', 'RAY_API_SERVER_ADDRESS', 'RAY_AUTH_MODE')}}))\n"
                      "print('Job succeeded')\n")
    monkeypatch.setattr(submit, "ray_command", lambda: [sys.executable, str(script)])
    for name in ("RAY_ADDRESS", "RAY_API_SERVER_ADDRESS", "RAY_AUTH_MODE"):
        monkeypatch.delenv(name, raising=False)
    return record


def test_the_address_flag_wins_over_ray_address_for_ray_too(fake_ray: Path, monkeypatch) -> None:
    monkeypatch.setenv("RAY_ADDRESS", "http://127.0.0.1:1")  # a cluster the user did not name
    with Dashboard(200) as dash:
        assert submit.main(["--address", dash.url, "--no-wait", "--", "python", "x.py"]) == 0
    call = json.loads(fake_ray.read_text())
    assert call["argv"] == ["job", "submit", "--address", dash.url, "--no-wait", "--", "python", "x.py"]
    assert call["env"]["RAY_ADDRESS"] is None and call["env"]["RAY_API_SERVER_ADDRESS"] is None


def test_a_bare_host_port_reaches_ray_as_the_dashboard_url_that_was_probed(fake_ray: Path) -> None:
    with Dashboard(200) as dash:
        bare = dash.url.removeprefix("http://")
        assert submit.main([f"--address={bare}", "--", "python", "x.py", "--address", "kept"]) == 0
    call = json.loads(fake_ray.read_text())
    assert call["argv"] == ["job", "submit", "--address", dash.url, "--", "python", "x.py", "--address", "kept"]


def test_ray_address_auto_is_left_to_ray(fake_ray: Path, monkeypatch, capsys) -> None:
    """``RAY_ADDRESS=auto`` (the README's setting on a head node) finds the local cluster in Ray's CLI;
    it is not an http host to probe."""
    monkeypatch.setenv("RAY_ADDRESS", "auto")
    monkeypatch.setenv("RAY_AUTH_TOKEN", "secret")
    monkeypatch.setattr(submit, "probe_auth", lambda *a, **k: pytest.fail("'auto' has no dashboard URL to probe"))
    assert submit.main(["--", "python", "x.py"]) == 0, capsys.readouterr().err
    call = json.loads(fake_ray.read_text())
    assert call["argv"] == ["job", "submit", "--", "python", "x.py"]
    assert call["env"] == {"RAY_ADDRESS": "auto", "RAY_API_SERVER_ADDRESS": None, "RAY_AUTH_MODE": "token"}
