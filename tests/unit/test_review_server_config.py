"""Review of the serve CLI's config precedence and submit's address handling: the serve-only flags
are flags (they win over a config file and are folded in before the config is checked), and
``--address auto`` wins over RAY_ADDRESS as every other ``--address`` does."""

from __future__ import annotations

import json
from pathlib import Path

from launch import serve, submit
from tests.unit.test_cli_qa_submit import fake_ray  # noqa: F401  (fixture)


def _serve_config(argv: list[str]):
    return serve.config_from_args(serve.build_parser().parse_args(argv))


def test_a_tool_call_parser_flag_completes_a_config_files_auto_tool_choice(tmp_path: Path) -> None:
    """vLLM: ``enable-auto-tool-choice: true`` in the config file plus ``--tool-call-parser hermes`` on the
    command line is a complete setup; it used to fail the file's check before the flag was applied."""
    for text in ("enable-auto-tool-choice: true\n", "server: {enable_auto_tool_choice: true}\n"):
        path = tmp_path / "cfg.yaml"
        path.write_text(text)
        cfg = _serve_config(["/ckpt/m", "--config", str(path), "--tool-call-parser", "hermes"])
        assert (cfg.server.enable_auto_tool_choice, cfg.server.tool_call_parser) == (True, "hermes")


def test_serve_only_flags_win_over_the_config_file(tmp_path: Path) -> None:
    path = tmp_path / "cfg.yaml"
    path.write_text("tool-call-parser: mistral\nexpert-distribution-recorder-buffer-size: 5\n")
    cfg = _serve_config(["/ckpt/m", "--config", str(path), "--tool-call-parser", "hermes",
                         "--expert-distribution-recorder-buffer-size", "7", "--enable-auto-tool-choice"])
    assert (cfg.server.tool_call_parser, cfg.server.expert_distribution_recorder_buffer_size) == ("hermes", 7)
    assert cfg.server.enable_auto_tool_choice


def test_address_auto_on_the_command_line_wins_over_ray_address(fake_ray: Path, monkeypatch) -> None:  # noqa: F811
    """Ray's CLI lets RAY_ADDRESS override ``--address``; ``--address auto`` (the cluster on this machine)
    must not be sent to the cluster RAY_ADDRESS names."""
    monkeypatch.setenv("RAY_ADDRESS", "http://127.0.0.1:1")
    monkeypatch.setenv("RAY_API_SERVER_ADDRESS", "http://127.0.0.1:2")
    monkeypatch.setattr(submit, "probe_auth", lambda *a, **k: False)
    assert submit.main(["--address", "auto", "--no-wait", "--", "python", "x.py"]) == 0
    call = json.loads(fake_ray.read_text())
    assert call["argv"] == ["job", "submit", "--address", "auto", "--no-wait", "--", "python", "x.py"]
    assert call["env"]["RAY_ADDRESS"] is None and call["env"]["RAY_API_SERVER_ADDRESS"] is None
