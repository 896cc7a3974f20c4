"""``python -m launch submit``: address resolution, token discovery, and the dashboard probe
against a stand-in dashboard on loopback (the real round trip is tests/ray/test_job_submit.py)."""

from __future__ import annotations

import http.server
import sys
import threading
from pathlib import Path

import pytest

from launch.submit import (
    SubmitError,
    check_address,
    has_auth_token,
    main,
    probe_auth,
    submission_address,
    submit_env,
)
from parallel.groups import free_port


class Dashboard:
    """Answers GET /api/version with ``status`` on a free loopback port."""

    def __init__(self, status: int) -> None:
        code = status

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                self.send_response(code)
                self.end_headers()
                self.wfile.write(b'{"version": "x"}' if code == 200 else b"Unauthorized")

            def log_message(self, *args) -> None:
                pass

        self.server = http.server.HTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> Dashboard:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_submission_address_follows_ray_job_cli():
    assert submission_address(["--address", "http://h:8265", "--", "python", "--address", "x"], {}) == "http://h:8265"
    assert submission_address(["--address=h:8265", "--", "x"], {}) == "http://h:8265"
    assert submission_address(["--", "x"], {"RAY_API_SERVER_ADDRESS": "http://a:1", "RAY_ADDRESS": "b:2"}) == "http://a:1"
    assert submission_address(["--", "x"], {"RAY_ADDRESS": "b:2"}) == "http://b:2"
    assert submission_address(["--", "x"], {}) == "http://127.0.0.1:8265"


def test_token_discovery(tmp_path: Path):
    assert not has_auth_token({}, home=tmp_path)
    assert has_auth_token({"RAY_AUTH_TOKEN": "abc"}, home=tmp_path)
    (tmp_path / ".ray").mkdir()
    (tmp_path / ".ray" / "auth_token").write_text("")
    assert not has_auth_token({}, home=tmp_path)  # empty file
    (tmp_path / ".ray" / "auth_token").write_text("0123abcd\n")
    assert has_auth_token({}, home=tmp_path)
    other = tmp_path / "tok"
    assert not has_auth_token({"RAY_AUTH_TOKEN_PATH": str(other)}, home=tmp_path)  # the named file wins
    other.write_text("t")
    assert has_auth_token({"RAY_AUTH_TOKEN_PATH": str(other)}, home=tmp_path)


def test_probe_and_env_against_a_dashboard(tmp_path: Path):
    (tmp_path / ".ray").mkdir()
    (tmp_path / ".ray" / "auth_token").write_text("secret")
    with Dashboard(401) as auth, Dashboard(200) as open_:
        assert probe_auth(auth.url) is True and probe_auth(open_.url) is False
        assert submit_env(auth.url, {"PATH": "/bin"}, home=tmp_path) == {"PATH": "/bin", "RAY_AUTH_MODE": "token"}
        assert "RAY_AUTH_MODE" not in submit_env(open_.url, {}, home=tmp_path)
        # An explicit choice is kept, whatever the cluster says.
        assert submit_env(auth.url, {"RAY_AUTH_MODE": "disabled"}, home=tmp_path)["RAY_AUTH_MODE"] == "disabled"
        with pytest.raises(SubmitError, match="run `ray get-auth-token` on the head node"):
            submit_env(auth.url, {}, home=tmp_path / "nohome")
    with Dashboard(500) as broken, pytest.raises(SubmitError, match="answered 500"):
        probe_auth(broken.url)
    with pytest.raises(SubmitError, match=r"no Ray dashboard answers at http://127.0.0.1:\d+"):
        probe_auth(f"http://127.0.0.1:{free_port()}", timeout_s=2)


def test_main_errors_are_one_line(capsys, monkeypatch):
    assert main(["--address", "http://127.0.0.1:1", "python", "x.py"]) == 2
    assert "after `--`" in capsys.readouterr().err
    monkeypatch.delenv("RAY_AUTH_MODE", raising=False)
    assert main(["--address", f"http://127.0.0.1:{free_port()}", "--", "python", "x.py"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: no Ray dashboard answers") and err.count("\n") == 1
    assert main(["--help"]) == 0 and "ray job submit" in capsys.readouterr().out


@pytest.mark.parametrize(("address", "problem"), [
    ("127.0.0.1:notaport", "not a valid dashboard URL (Port could not be cast to integer value as 'notaport')"),
    ("http://[::1", "not a valid dashboard URL (Invalid IPv6 URL)"),
    ("http://h:99999", "not a valid dashboard URL (Port out of range"),
    ("http://:8265", "no host name"),
    ("nonsense://x", "unsupported scheme 'nonsense' (only http:// and https://)"),
    ("ray://127.0.0.1:10001", "ray:// is a Ray Client address, not the job submission API"),
])
def test_a_bad_address_is_one_line_before_ray_runs(address, problem, capsys, monkeypatch):
    import launch.submit as submit

    monkeypatch.delenv("RAY_AUTH_MODE", raising=False)
    monkeypatch.setattr(submit, "ray_command", lambda: pytest.fail("ray job submit must not run"))
    monkeypatch.setattr(submit, "probe_auth", lambda *a, **k: pytest.fail("the dashboard must not be probed"))
    assert main(["--address", address, "--", "echo", "hi"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: --address {address}: {problem}") and err.count("\n") == 1, err
    assert "--address http://HEAD:8265" in err


def test_check_address_keeps_good_addresses_and_names_the_variable():
    assert check_address(["--address", "https://head.example.com/ray", "--", "x"], {}) == \
        "https://head.example.com/ray"
    assert check_address(["--address=h:8265", "--", "x"], {}) == "http://h:8265"
    assert check_address(["--address", "http://[::1]:8265", "--", "x"], {}) == "http://[::1]:8265"
    assert check_address(["--", "x"], {}) == "http://127.0.0.1:8265"
    with pytest.raises(SubmitError, match=r"^RAY_ADDRESS=ray://h:10001: ray:// is a Ray Client address"):
        check_address(["--", "x"], {"RAY_ADDRESS": "ray://h:10001"})
    # A URL the check lets through but urllib refuses is still a SubmitError, not a traceback.
    with pytest.raises(SubmitError, match="not a valid dashboard URL"):
        probe_auth("http://h:1/a b\n", timeout_s=1)


def test_submission_retries_while_the_head_has_no_job_agent(monkeypatch, tmp_path, capsys):
    """'No available agent' means nothing was submitted: try again; other failures are final."""
    import launch.submit as submit

    calls = []
    script = tmp_path / "fake_ray.py"
    script.write_text("import sys, pathlib\n"
                      "p = pathlib.Path(sys.argv[1]); n = int(p.read_text() or 0) if p.exists() else 0\n"
                      "p.write_text(str(n + 1))\n"
                      "print('RuntimeError: Request failed with status code 500: No available agent to submit job, '\n"
                      "      'please try again later..' if n < 2 else 'Job succeeded')\n"
                      "sys.exit(1 if n < 2 else 0)\n")
    counter = tmp_path / "n"
    monkeypatch.setattr(submit, "ray_command", lambda: [sys.executable, str(script), str(counter)])
    monkeypatch.setattr(submit, "submit_env", lambda address, env: calls.append(address) or dict(env))
    monkeypatch.setattr(submit.time, "sleep", lambda s: None)
    assert submit.main(["--address", "http://h:1", "--", "python", "x.py"]) == 0
    assert counter.read_text() == "3" and calls == ["http://h:1"]
    out = capsys.readouterr()
    assert out.out.count("No available agent") == 2 and "Job succeeded" in out.out
    assert out.err.count("job agent is not up yet") == 2
    # A job that fails for another reason is not resubmitted.
    script.write_text("import sys\nprint('Job failed')\nsys.exit(3)\n")
    assert submit.main(["--", "python", "x.py"]) == 3


@pytest.mark.parametrize("flags", [["--address"], ["--address="], ["--address", "--no-wait"]])
def test_an_address_flag_without_a_value_is_refused_not_defaulted(flags, capsys, monkeypatch):
    """``--address`` with nothing after it must not fall back to the default dashboard (a job could
    land on a local cluster the user did not mean)."""
    import launch.submit as submit

    monkeypatch.setattr(submit, "ray_command", lambda: pytest.fail("ray job submit must not run"))
    monkeypatch.setattr(submit, "probe_auth", lambda *a, **k: pytest.fail("the dashboard must not be probed"))
    assert main([*flags, "--", "echo", "hi"]) == 2
    assert capsys.readouterr().err == ("error: --address needs a value: the head's dashboard, e.g. "
                                       "--address http://HEAD:8265\n")
