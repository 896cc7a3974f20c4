"""Text that is not valid Unicode (an unpaired UTF-16 surrogate, as JSON's ``"\\ud800"`` escape
decodes) and odd token ids: a 400 / ValueError naming the field, never a 500 or a traceback.

Every entry point is covered: the wire models, the HTTP routes (completions, chat, text
parts, stop strings, model name), the tokenizer wrapper (the real ``tokenizers`` backend
raises ``TypeError: TextInputSequence must be str`` on such text), and the JSONL reader of
``python -m launch generate``.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import httpx
import pytest
from pydantic import ValidationError

from launch.generate import main as generate_main
from launch.generate import read_requests
from launch.server import build_app
from launch.server.protocol import ChatCompletionRequest, CompletionRequest
from launch.tiny_checkpoint import train_tokenizer
from launch.tokenizer import InvalidTextError, Tokenizer, check_text
from tests.unit.server_fakes import FakeEngine, ServerThread

SURROGATE = "a\ud800b"


def server_config(**overrides):
    base = dict(api_key=None, served_model_name=None, max_queue_len=8, expert_distribution_dir=None)
    return SimpleNamespace(**{**base, **overrides})


@pytest.fixture(scope="module")
def served():
    engine = FakeEngine()
    with ServerThread(build_app(engine, server_config())) as srv:
        yield SimpleNamespace(engine=engine, url=srv.base_url)


def post_raw(url: str, body: str) -> httpx.Response:
    """POST a JSON text as written: ``\\ud800`` stays an escape, as a client would send it."""
    return httpx.post(url, content=body.encode("ascii"), headers={"Content-Type": "application/json"}, timeout=10)


def test_check_text_names_the_field_and_position():
    assert check_text("héllo 🙂", "prompt") == "héllo 🙂"
    with pytest.raises(InvalidTextError, match=r"prompt holds an unpaired UTF-16 surrogate \(U\+D800\) at character 1"):
        check_text(SURROGATE, "prompt")
    with pytest.raises(ValueError, match=r"U\+DFFF\) at character 0"):
        check_text("\udfff", "x")


def test_wire_models_reject_surrogates_in_every_text_field():
    cases = [(CompletionRequest, dict(prompt=SURROGATE), "prompt holds"),
             (CompletionRequest, dict(prompt=["ok", SURROGATE]), r"prompt\[1\] holds"),
             (CompletionRequest, dict(prompt="x", stop=["ok", "\ud800"]), r"stop\[1\] holds"),
             (CompletionRequest, dict(prompt="x", model="\udc00"), "model holds"),
             (CompletionRequest, dict(prompt="x", user="\udc00"), "user holds"),
             (ChatCompletionRequest, dict(messages=[{"role": "user", "content": SURROGATE}]), "content holds"),
             (ChatCompletionRequest, dict(messages=[{"role": "user", "content": [{"type": "text", "text": "\ud800"}]}]),
              "text holds"),
             (ChatCompletionRequest, dict(messages=[{"role": "user", "content": "x", "name": "\ud800"}]), "name holds")]
    for model, kwargs, match in cases:
        with pytest.raises(ValidationError, match=match):
            model(**kwargs)
    # Surrogate pairs written as escapes decode to one valid character.
    assert CompletionRequest.model_validate(json.loads('{"prompt": "\\ud83d\\ude00"}')).prompt == "😀"


@pytest.mark.parametrize("route,body,param,where", [
    ("/v1/completions", '{"prompt": "a\\ud800b", "max_tokens": 2}', "prompt", "prompt holds"),
    ("/v1/completions", '{"prompt": ["ok", "\\udfff"], "max_tokens": 2}', "prompt", "prompt[1] holds"),
    ("/v1/completions", '{"prompt": "ok", "stop": "\\ud800", "max_tokens": 2}', "stop", "stop holds"),
    ("/v1/completions", '{"prompt": "ok", "model": "\\ud800"}', "model", "model holds"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "a\\ud800b"}]}', "messages", "content holds"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\ud800"}]}]}',
     "messages", "text holds"),
])
def test_http_surrogates_are_400_naming_the_field(served, route, body, param, where):
    r = post_raw(served.url + route, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param and err["code"] == 400
    assert where in err["message"] and "unpaired UTF-16 surrogate" in err["message"]
    assert "Value error" not in err["message"] and "function-after" not in err["message"]


def test_http_token_id_edge_cases_are_400(served):
    for body, param in [('{"prompt": [1, 95]}', "prompt"),  # == vocab size
                        ('{"prompt": [[1], [1180591620717411303424]]}', "prompt"),  # 2**70
                        ('{"prompt": [-1]}', "prompt"),
                        ('{"prompt": [1, 2.5]}', "prompt"),
                        ('{"prompt": [[]]}', "prompt"),
                        ('{"prompt": [true]}', "prompt"),
                        ('{"prompt": "x", "stop_token_ids": [-3]}', "stop_token_ids")]:
        r = post_raw(served.url + "/v1/completions", body)
        assert r.status_code == 400, (body, r.text)
        assert r.json()["error"]["param"] == param, (body, r.json())
    ok = post_raw(served.url + "/v1/completions", '{"prompt": [0, 94], "max_tokens": 1}')
    assert ok.status_code == 200, ok.text


def test_error_bodies_render_whatever_the_message_holds():
    from launch.server.app import error_response

    r = error_response(400, f"bad {SURROGATE} and é")
    body = json.loads(r.body)
    assert body["error"]["message"] == f"bad {SURROGATE} and é"


@pytest.fixture(scope="module")
def tok():
    return Tokenizer(train_tokenizer(512), bos_token="<|bos|>", eos_token="<|eos|>", eos_token_ids=[1],
                     bos_token_id=0, chat_template=None, add_bos=True)


def test_tokenizer_entry_points_raise_value_error(tok):
    with pytest.raises(InvalidTextError, match="the prompt holds an unpaired"):
        tok.encode(SURROGATE)
    with pytest.raises(InvalidTextError, match=r"messages\[1\].content holds"):
        tok.encode_chat([{"role": "system", "content": "ok"}, {"role": "user", "content": SURROGATE}])
    with pytest.raises(InvalidTextError, match=r"messages\[0\].content holds"):
        tok.apply_chat_template([{"role": "user", "content": [{"type": "text", "text": "\ud800"}]}])
    assert tok.decode(tok.encode("ok 🙂", add_special_tokens=False)) == "ok 🙂"


def test_server_maps_a_tokenizer_value_error_to_400(tok):
    """Behind the wire check: a tokenizer that rejects text still gives a 400, not a 500."""
    from launch.server.protocol import APIError
    from launch.server.serving import OpenAIServing

    engine = SimpleNamespace(tokenizer=tok, model_config=SimpleNamespace(vocab_size=512))
    serving = OpenAIServing(engine, "m", metrics=None)
    with pytest.raises(APIError) as info:
        serving.tokenize(SURROGATE)
    assert info.value.status_code == 400 and info.value.param == "prompt"
    assert serving.tokenize("ok")[0] == 0  # bos


def test_generate_jsonl_rejects_bad_prompts_before_starting(tmp_path, capsys):
    cases = ['{"prompt": "a\\ud800b"}', '{"prompt": ""}', '{"prompt": 5}', '{"prompt_token_ids": []}',
             '{"prompt_token_ids": [1, -2]}', '{"prompt_token_ids": [1, true]}', '{"prompt_token_ids": "12"}']
    for i, line in enumerate(cases):
        src = tmp_path / f"in{i}.jsonl"
        src.write_text('{"prompt": "fine"}\n' + line + "\n")
        with pytest.raises(ValueError, match=rf"in{i}.jsonl:2: 'prompt"):
            read_requests(src)
    # The CLI turns it into a one-line error and exit code 2 before any model is loaded.
    src = tmp_path / "in0.jsonl"
    assert generate_main(["--model", str(tmp_path / "no-such-model"), "--input", str(src),
                          "--output", str(tmp_path / "out.jsonl")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "unpaired UTF-16 surrogate" in err and "Traceback" not in err


def test_fan_out_beyond_the_queue_is_400_not_503(served):
    """prompts x n engine requests that could never all be queued: a 400 saying why (a 503
    would invite retries that cannot succeed); at the limit the request is served."""
    url = served.url + "/v1/completions"
    r = httpx.post(url, json={"prompt": "x", "n": 9, "max_tokens": 1}, timeout=10)  # max_queue_len=8
    assert r.status_code == 400 and r.json()["error"]["param"] == "n"
    assert "needs 9 engine requests" in r.json()["error"]["message"]
    r = httpx.post(url, json={"prompt": ["a", "b", "c"], "n": 3, "max_tokens": 1}, timeout=10)
    assert r.status_code == 400 and "3 prompt(s) x n=3" in r.json()["error"]["message"]
    r = httpx.post(url, json={"prompt": [[1]] * 9, "max_tokens": 1}, timeout=10)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    r = httpx.post(url, json={"prompt": ["a", "b"], "n": 4, "max_tokens": 1}, timeout=10)
    assert r.status_code == 200 and len(r.json()["choices"]) == 8
