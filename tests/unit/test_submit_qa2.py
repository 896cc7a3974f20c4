"""``python -m launch submit`` off the happy path (second QA pass), against stand-in servers on
loopback: a token the head refuses and an address that answers but is no dashboard (the GCS
port) are one line, exit 2, before ``ray job submit`` runs (it would print a traceback)."""

from __future__ import annotations

import http.server
import socket
import threading
from pathlib import Path

import pytest

from launch import submit
from launch.submit import SubmitError, check_token, find_auth_token, main, probe_auth, submit_env


class TokenDashboard:
    """Ray's dashboard under token authentication: 401 without an Authorization header, 403 with a
    wrong token, 200 with ``Bearer TOKEN``."""

    def __init__(self, token: str) -> None:
        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                given = self.headers.get("Authorization")
                code = 401 if given is None else 200 if given == f"Bearer {token}" else 403
                self.send_response(code)
                self.end_headers()
                self.wfile.write(b"{}")

            def log_message(self, *args) -> None:
                pass

        self.server = http.server.HTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> TokenDashboard:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()


class NotHttp:
    """Answers every connection with bytes that are no HTTP status line (as a gRPC port does)."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen()
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.thread = threading.Thread(target=self._serve, daemon=True)

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            conn.recv(4096)
            conn.sendall(b"\x00\x00\x12\x04\x00\x00\x00\x00\x00garbage\r\n\r\n")
            conn.close()

    def __enter__(self) -> NotHttp:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.sock.close()


def test_a_token_the_head_refuses_is_one_line_naming_where_it_came_from(tmp_path: Path):
    with TokenDashboard("right") as dash:
        with pytest.raises(SubmitError, match="refused the token from RAY_AUTH_TOKEN"):
            submit_env(dash.url, {"RAY_AUTH_TOKEN": "wrong"}, home=tmp_path)
        with pytest.raises(SubmitError, match="refused the token from RAY_AUTH_TOKEN"):  # token mode set by hand
            submit_env(dash.url, {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": "wrong"}, home=tmp_path)
        (tmp_path / ".ray").mkdir()
        (tmp_path / ".ray" / "auth_token").write_text("stale\n")
        with pytest.raises(SubmitError, match=r"refused the token from .*\.ray/auth_token"):
            submit_env(dash.url, {}, home=tmp_path)
        assert submit_env(dash.url, {"RAY_AUTH_TOKEN": "right"}, home=tmp_path)["RAY_AUTH_MODE"] == "token"
        check_token(dash.url, {"RAY_AUTH_TOKEN": "right"}, home=tmp_path)


def test_main_refuses_a_wrong_token_before_ray_runs(tmp_path: Path, monkeypatch, capsys):
    ran = []
    monkeypatch.setattr(submit, "run_passing_output", lambda cmd, env: ran.append(cmd) or (0, False))
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("RAY_AUTH_MODE", raising=False)
    monkeypatch.setenv("RAY_AUTH_TOKEN", "wrong")
    with TokenDashboard("right") as dash:
        assert main(["--address", dash.url, "--", "echo", "hi"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: the Ray cluster at") and "ray get-auth-token" in err
    assert ran == []


def test_an_address_that_is_not_a_dashboard_is_one_line(monkeypatch, capsys):
    with NotHttp() as gcs:
        with pytest.raises(SubmitError, match=r"answered, but not as a Ray dashboard does .*GCS port"):
            probe_auth(gcs.url, timeout_s=5)
        monkeypatch.delenv("RAY_AUTH_MODE", raising=False)
        assert main(["--address", gcs.url, "--", "echo", "hi"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err


def test_find_auth_token_follows_rays_order(tmp_path: Path):
    (tmp_path / ".ray").mkdir()
    (tmp_path / ".ray" / "auth_token").write_text("home\n")
    assert find_auth_token({}, home=tmp_path) == ("home", str(tmp_path / ".ray" / "auth_token"))
    assert find_auth_token({"RAY_AUTH_TOKEN": " env "}, home=tmp_path) == ("env", "RAY_AUTH_TOKEN")
    assert find_auth_token({"RAY_AUTH_TOKEN_PATH": str(tmp_path / "none")}, home=tmp_path) is None


@pytest.mark.parametrize(("flags", "problem"), [
    (["--adress", "http://127.0.0.1:1"], "`ray job submit` has no flag --adress (did you mean --address?)"),
    (["--working_dir=."], "`ray job submit` has no flag --working_dir (did you mean --working-dir?)"),
])
def test_a_misspelt_flag_is_named_before_any_address_is_probed(flags, problem, monkeypatch, capsys):
    monkeypatch.setattr(submit, "probe_auth", lambda *a, **k: pytest.fail("probed"))
    assert main([*flags, "--", "echo", "hi"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and problem in err


def test_every_documented_flag_passes_the_check():
    assert submit.unknown_flag(["--address", "http://h:8265", "--working-dir", ".", "--no-wait",
                                "--runtime-env-json", "{}", "--submission-id=x", "-v", "--", "python", "--bogus"]) is None
