"""vLLM's ``--chat-template``: a Jinja file or an inline template that renders every chat request (chat
completions, /tokenize, /v1/responses) instead of the checkpoint's; a bad value is one line before the
weights load."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from launch.server import build_app
from launch.tiny_checkpoint import train_tokenizer
from launch.tokenizer import Tokenizer, load_chat_template
from tests.unit.server_fakes import FakeEngine, ServerThread
from tests.unit.test_server_protocol import server_config

INLINE = "{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}{% if add_generation_prompt %}[bot]{% endif %}"


def test_a_file_an_inline_template_and_what_is_neither(tmp_path: Path):
    file = tmp_path / "t.jinja"
    file.write_text(INLINE)
    assert load_chat_template(str(file)) == INLINE == load_chat_template(INLINE)
    long = "{# a real template is long #}" * 40 + INLINE  # over the 255 bytes a file name may have
    assert load_chat_template(long) == long
    with pytest.raises(ValueError, match=r"^--chat-template 'nope.jinja': no such file \(an inline template holds"):
        load_chat_template("nope.jinja")
    file.write_text("{% for m in messages %}")
    with pytest.raises(ValueError, match=rf"^--chat-template {file}: not a valid Jinja template \(.*line 1\)$"):
        load_chat_template(str(file))
    with pytest.raises(ValueError, match=r"^--chat-template: not a valid Jinja template"):
        load_chat_template("{{ x ")
    file.write_bytes(b"\xff\xfe{{")
    with pytest.raises(ValueError, match="not UTF-8 text"):
        load_chat_template(str(file))


def test_the_server_renders_every_chat_route_with_it():
    engine = FakeEngine(max_model_len=4096)
    engine.tokenizer = Tokenizer(train_tokenizer(512), bos_token="<|bos|>", eos_token="<|eos|>", eos_token_ids=[1],
                                 bos_token_id=0, chat_template="{{ 'the checkpoint template' }}", add_bos=True)
    engine.model_config.vocab_size = 512
    messages = [{"role": "user", "content": "hi"}]
    want = engine.tokenizer.encode("[user]hi[bot]", add_special_tokens=False)
    with ServerThread(build_app(engine, server_config(chat_template=INLINE))) as srv:
        r = httpx.post(srv.base_url + "/tokenize", json={"messages": messages, "add_generation_prompt": True})
        assert r.status_code == 200 and r.json()["tokens"] == want, r.text
        r = httpx.post(srv.base_url + "/v1/chat/completions", json={"messages": messages, "max_tokens": 1})
        assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == len(want), r.text
        r = httpx.post(srv.base_url + "/v1/responses", json={"input": "hi", "max_output_tokens": 1})
        assert r.status_code == 200 and r.json()["usage"]["input_tokens"] == len(want), r.text
    with ServerThread(build_app(engine, server_config())) as srv:  # without the flag: the checkpoint's
        r = httpx.post(srv.base_url + "/tokenize", json={"messages": messages})
        assert r.json()["tokens"] == engine.tokenizer.encode("the checkpoint template", add_special_tokens=False)


def test_serve_refuses_a_bad_value_in_one_line_before_loading(tmp_path: Path, capsys):
    from launch.serve import main

    for argv, message in (
            (["--chat-template", str(tmp_path / "missing.jinja")], "missing.jinja': no such file"),
            (["--config", str(tmp_path / "c.yaml")], "not a valid Jinja template")):
        (tmp_path / "c.yaml").write_text('chat-template: "{% if %}"\n')
        assert main([str(tmp_path / "no-model"), "--port", "0", *argv]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: --chat-template") and message in err and err.count("\n") == 1, err
