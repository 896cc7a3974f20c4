"""bench serve: input the server would refuse for every request is a one-line error (exit 2) before
any benchmark request is sent: sampling flags out of range, a model the server does not serve,
lengths beyond its max_model_len, a --vocab-size beyond the known vocabulary, a backend/endpoint
mismatch, a --result-filename that could leave --result-dir, a bad --port / --base-url / --host.

A tiny local HTTP server fakes ``/v1/models`` and counts every other request."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from launch.bench import serve as bench_serve
from launch.bench import serve_client
from launch.bench.serve import context_problem, is_plain_file_name, main
from launch.bench.serve_client import RequestInput, base_url_of, resolve_target, target_flags_problem


class FakeModels:
    """``GET /v1/models`` answers ``status`` with ``cards``; anything else is counted, then 500."""

    def __init__(self) -> None:
        self.status = 200
        self.cards: list[dict[str, Any]] = [{"id": "served-a", "object": "model", "max_model_len": 64},
                                            {"id": "served-b", "object": "model", "max_model_len": 64}]
        self.other_requests: list[str] = []
        self.base_url = ""


@pytest.fixture
def fake_server() -> Iterator[FakeModels]:
    state = FakeModels()

    class Handler(BaseHTTPRequestHandler):
        def _reply(self, status: int, body: bytes) -> None:
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            if self.path == "/v1/models":
                self._reply(state.status, json.dumps({"object": "list", "data": state.cards}).encode())
            else:
                state.other_requests.append(f"GET {self.path}")
                self._reply(500, b"{}")

        def do_POST(self) -> None:  # noqa: N802
            state.other_requests.append(f"POST {self.path}")
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            self._reply(500, b"{}")

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    state.base_url = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True)
    thread.start()
    try:
        yield state
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


def run_main(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main([*argv, "--num-prompts", "3", "--disable-tqdm"])
    printed = capsys.readouterr()
    return rc, printed.out, printed.err


def assert_one_line_error(rc: int, out: str, err: str, line: str) -> None:
    assert rc == 2
    assert out == ""
    assert err == f"error: {line}\n"


async def _refuse(*args, **kwargs):
    raise AssertionError("the server was contacted for bad input")


# ---------------------------------------------------------------- 1. sampling flags


@pytest.mark.parametrize("value", ["-1", "nan", "inf", "-0.001"])
def test_a_temperature_the_server_refuses_is_named_before_contacting_it(value, monkeypatch, capsys) -> None:
    monkeypatch.setattr(bench_serve, "resolve_target", _refuse)
    rc, out, err = run_main(capsys, "--vocab-size", "9", "--temperature", value)
    assert_one_line_error(rc, out, err, f"--temperature must be a finite number >= 0, got {float(value)}")


@pytest.mark.parametrize("value", ["0", "0.7", "2"])
def test_valid_temperatures_pass(value) -> None:
    args = bench_serve.build_parser().parse_args(["--temperature", value])
    assert target_flags_problem(args) is None


def test_a_vocab_size_below_one_is_named_before_contacting_the_server(monkeypatch, capsys) -> None:
    monkeypatch.setattr(bench_serve, "resolve_target", _refuse)
    rc, out, err = run_main(capsys, "--vocab-size", "0")
    assert_one_line_error(rc, out, err, "--vocab-size must be >= 1, got 0")


# ---------------------------------------------------------------- 2. the model


def test_a_model_the_server_does_not_serve_is_refused_listing_the_served_ones(fake_server, capsys) -> None:
    rc, out, err = run_main(capsys, "--base-url", fake_server.base_url, "--vocab-size", "50",
                            "--random-input-len", "4", "--random-output-len", "2", "--model", "other")
    assert_one_line_error(rc, out, err, f"--model other is not served by {fake_server.base_url}; "
                                        "it serves: served-a, served-b")
    assert fake_server.other_requests == []


def test_a_served_model_and_the_default_resolve(fake_server) -> None:
    parser = bench_serve.build_parser()
    for flags, model in ((["--model", "served-b"], "served-b"), ([], "served-a")):
        args = parser.parse_args(["--base-url", fake_server.base_url, "--vocab-size", "50", *flags])
        target, vocab, avoid = asyncio.run(resolve_target(args))
        assert (target.model, target.max_model_len, vocab, avoid) == (model, 64, 50, ())
        assert target.url == fake_server.base_url + "/v1/completions"
    assert fake_server.other_requests == []


def test_a_model_list_that_cannot_be_read_leaves_a_named_model_unchecked(fake_server, capsys) -> None:
    fake_server.status = 404
    args = bench_serve.build_parser().parse_args(["--base-url", fake_server.base_url, "--vocab-size", "50",
                                                  "--model", "anything"])
    target, _, _ = asyncio.run(resolve_target(args))
    assert (target.model, target.max_model_len) == ("anything", None)
    # without --model there is no model to send to: named, one line
    rc, out, err = run_main(capsys, "--base-url", fake_server.base_url, "--vocab-size", "50")
    assert rc == 2 and out == "" and err.count("\n") == 1
    assert err.startswith(f"error: GET {fake_server.base_url}/v1/models returned 404")


def test_an_empty_model_list_is_named(fake_server, capsys) -> None:
    fake_server.cards = []
    rc, out, err = run_main(capsys, "--base-url", fake_server.base_url, "--vocab-size", "50")
    assert_one_line_error(rc, out, err, f"{fake_server.base_url}/v1/models lists no model")
    rc, out, err = run_main(capsys, "--base-url", fake_server.base_url, "--vocab-size", "50", "--model", "m")
    assert_one_line_error(rc, out, err, f"--model m is not served by {fake_server.base_url}; it serves: no model")


def test_an_unreachable_server_is_one_line(capsys) -> None:
    from parallel.groups import free_port
    rc, out, err = run_main(capsys, "--port", str(free_port()), "--vocab-size", "50", "--model", "m")
    assert rc == 2 and out == "" and err.count("\n") == 1 and err.startswith("error: cannot reach http://127.0.0.1:")


# ---------------------------------------------------------------- 3. lengths and vocabulary


@pytest.mark.parametrize(("flags", "line"), [
    (["--random-input-len", "60", "--random-output-len", "5"],
     "--random-input-len 60 + --random-output-len 5 give requests of up to 65 tokens (60 prompt + 5 output), "
     "more than the max_model_len 64 of model served-a"),
    (["--random-input-len", "4", "--random-output-len", "2", "--random-prefix-len", "60"],
     "--random-input-len 4 + --random-output-len 2 + --random-prefix-len 60 give requests of up to 66 tokens "
     "(64 prompt + 2 output), more than the max_model_len 64 of model served-a"),
    (["--random-input-len", "100", "--random-output-len", "1"],
     "--random-input-len 100 + --random-output-len 1 give requests of up to 101 tokens (100 prompt + 1 output), "
     "more than the max_model_len 64 of model served-a"),
])
def test_lengths_beyond_max_model_len_are_refused_before_any_request(flags, line, fake_server, capsys) -> None:
    rc, out, err = run_main(capsys, "--base-url", fake_server.base_url, "--vocab-size", "50", *flags)
    assert_one_line_error(rc, out, err, line)
    assert fake_server.other_requests == []


def test_the_range_ratio_counts_the_longest_drawn_request(fake_server, capsys) -> None:
    rc, out, err = run_main(capsys, "--base-url", fake_server.base_url, "--vocab-size", "50",
                            "--random-input-len", "40", "--random-output-len", "20", "--random-range-ratio", "0.5",
                            "--num-prompts", "50")
    assert rc == 2 and out == "" and err.count("\n") == 1
    assert err.startswith("error: --random-input-len 40 + --random-output-len 20 (--random-range-ratio 0.5) "
                          "give requests of up to ")
    assert err.rstrip().endswith("more than the max_model_len 64 of model served-a")
    assert fake_server.other_requests == []


def test_context_problem_boundaries() -> None:
    args = bench_serve.build_parser().parse_args([])
    fits = [RequestInput(prompt_token_ids=[1] * 60, output_len=4)]
    assert context_problem(fits, 64, "m", args) is None
    assert context_problem(fits, None, "m", args) is None  # the server did not say: unchecked
    assert context_problem(fits, 63, "m", args) is not None


def test_a_vocab_size_beyond_the_tokenizers_is_refused_before_the_server_is_asked(tmp_path, monkeypatch,
                                                                                   capsys) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 50, "eos_token_id": 2}))
    monkeypatch.setattr(serve_client, "fetch_models", _refuse)
    rc, out, err = run_main(capsys, "--port", "9", "--tokenizer", str(tmp_path), "--vocab-size", "51")
    assert_one_line_error(rc, out, err, f"--vocab-size 51 is larger than the vocabulary of --tokenizer {tmp_path} "
                                        "(50 token ids)")
    rc, out, err = run_main(capsys, "--port", "9", "--model", str(tmp_path), "--vocab-size", "51")
    assert_one_line_error(rc, out, err, f"--vocab-size 51 is larger than the vocabulary of --model {tmp_path} "
                                        "(50 token ids)")


def test_a_vocab_size_within_the_tokenizers_passes(tmp_path, fake_server) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 50, "eos_token_id": 2}))
    args = bench_serve.build_parser().parse_args(["--base-url", fake_server.base_url, "--tokenizer", str(tmp_path),
                                                  "--vocab-size", "50"])
    _, vocab, avoid = asyncio.run(resolve_target(args))
    assert (vocab, avoid) == (50, (2,))


def test_a_vocab_size_beyond_the_servers_is_refused(tmp_path, fake_server, capsys) -> None:
    fake_server.cards = [{"id": "served-a", "max_model_len": 64, "vocab_size": 40}]
    rc, out, err = run_main(capsys, "--base-url", fake_server.base_url, "--vocab-size", "41",
                            "--random-input-len", "4", "--random-output-len", "2")
    assert_one_line_error(rc, out, err, "--vocab-size 41 is larger than the vocabulary of the served model "
                                        "served-a (40 token ids)")
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 50}))
    rc, out, err = run_main(capsys, "--base-url", fake_server.base_url, "--tokenizer", str(tmp_path),
                            "--random-input-len", "4", "--random-output-len", "2")
    assert_one_line_error(rc, out, err, f"the vocab_size 50 of {tmp_path} is larger than the vocabulary of the "
                                        "served model served-a (40 token ids)")
    assert fake_server.other_requests == []


# ---------------------------------------------------------------- 4. backend and endpoint


@pytest.mark.parametrize("backend", ["vllm", "openai"])
def test_the_chat_endpoint_with_a_completions_backend_is_refused(backend, monkeypatch, capsys) -> None:
    monkeypatch.setattr(bench_serve, "resolve_target", _refuse)
    rc, out, err = run_main(capsys, "--vocab-size", "9", "--backend", backend, "--endpoint", "/v1/chat/completions")
    assert_one_line_error(rc, out, err, f"--backend {backend} sends completions requests (token-id prompts), not "
                                        "chat ones: --endpoint /v1/chat/completions is the chat API; "
                                        "use --endpoint /v1/completions")


@pytest.mark.parametrize(("endpoint", "line"), [
    ("v1/completions", "--endpoint must be a path starting with '/', got 'v1/completions'"),
    ("/v1/embeddings", "--backend openai sends OpenAI completions requests: --endpoint must be a completions "
                       "path such as /v1/completions, got '/v1/embeddings'"),
])
def test_endpoints_that_cannot_take_completions_are_refused(endpoint, line, monkeypatch, capsys) -> None:
    monkeypatch.setattr(bench_serve, "resolve_target", _refuse)
    assert_one_line_error(*run_main(capsys, "--vocab-size", "9", "--endpoint", endpoint), line)


@pytest.mark.parametrize("endpoint", ["/v1/completions", "/proxy/v1/completions", "/v1/completions?api-version=1"])
def test_completions_endpoints_pass(endpoint) -> None:
    args = bench_serve.build_parser().parse_args(["--backend", "vllm", "--endpoint", endpoint])
    assert target_flags_problem(args) is None


# ---------------------------------------------------------------- 5. the result file name


@pytest.mark.parametrize("name", ["a/../../x/", "..", ".", "sub/r.json", "/abs/r.json", ""])
def test_a_result_filename_that_is_not_a_plain_name_is_refused_with_a_result_dir(name, tmp_path, monkeypatch,
                                                                                   capsys) -> None:
    monkeypatch.setattr(bench_serve, "resolve_target", _refuse)
    rc, out, err = run_main(capsys, "--vocab-size", "9", "--save-result", "--result-dir", str(tmp_path / "d"),
                            "--result-filename", name)
    assert_one_line_error(rc, out, err, "--result-filename must be a plain file name (no path separator, not . "
                                        f"or ..) inside --result-dir, got {name!r}")
    assert not (tmp_path / "d").exists() and list(tmp_path.iterdir()) == []


def test_plain_file_names() -> None:
    assert is_plain_file_name("r.json") and is_plain_file_name("..r.json") and is_plain_file_name("a..b")
    assert not any(is_plain_file_name(n) for n in ("", ".", "..", "a/b", "a/", "/a"))


# ---------------------------------------------------------------- 6. where to connect


@pytest.mark.parametrize(("flags", "line"), [
    (["--port", "70000"], "--port must be in 1-65535, got 70000"),
    (["--port", "0"], "--port must be in 1-65535, got 0"),
    (["--port", "-1"], "--port must be in 1-65535, got -1"),
    (["--base-url", "notaurl"],
     "--base-url must be an http:// or https:// URL with a host (no http:// or https:// scheme), got 'notaurl'"),
    (["--base-url", "ftp://host"],
     "--base-url must be an http:// or https:// URL with a host (no http:// or https:// scheme), got 'ftp://host'"),
    (["--base-url", "http://"], "--base-url must be an http:// or https:// URL with a host (no host), got 'http://'"),
    (["--base-url", "localhost:8000"],
     "--base-url must be an http:// or https:// URL with a host (no http:// or https:// scheme), "
     "got 'localhost:8000'"),
    (["--host", ""], "--host must be a host name or IP address, got ''"),
    (["--host", "a b/c"], "--host must be a host name or IP address, got 'a b/c'"),
])
def test_bad_connection_flags_are_named_before_connecting(flags, line, monkeypatch, capsys) -> None:
    monkeypatch.setattr(bench_serve, "resolve_target", _refuse)
    assert_one_line_error(*run_main(capsys, "--vocab-size", "9", *flags), line)


def test_a_base_url_port_out_of_range_is_named(monkeypatch, capsys) -> None:
    monkeypatch.setattr(bench_serve, "resolve_target", _refuse)
    rc, out, err = run_main(capsys, "--vocab-size", "9", "--base-url", "http://host:99999")
    assert rc == 2 and out == "" and err.count("\n") == 1
    assert err.startswith("error: --base-url must be an http:// or https:// URL with a host (")
    assert err.endswith("got 'http://host:99999'\n")


@pytest.mark.parametrize(("flags", "url"), [
    ([], "http://127.0.0.1:8000"),
    (["--host", "::1", "--port", "9000"], "http://[::1]:9000"),
    (["--host", "example.com", "--port", "65535"], "http://example.com:65535"),
    (["--base-url", "https://h.example/api/"], "https://h.example/api"),
])
def test_good_connection_flags_pass(flags, url) -> None:
    args = bench_serve.build_parser().parse_args(flags)
    assert target_flags_problem(args) is None
    assert base_url_of(args) == url


def test_the_served_cards_root_gives_the_vocabulary_when_no_flag_does(tmp_path, fake_server, capsys) -> None:
    # the server's /v1/models card names its checkpoint directory (vLLM's ``root``): on this machine,
    # its config.json stands in for --tokenizer
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 50, "eos_token_id": 2, "bos_token_id": 0}))
    fake_server.cards = [{"id": "served-a", "max_model_len": 64, "root": str(tmp_path)}]
    args = bench_serve.build_parser().parse_args(["--base-url", fake_server.base_url])
    target, vocab, avoid = asyncio.run(resolve_target(args))
    assert (target.model, vocab, avoid) == ("served-a", 50, (2, 0))
    # a root that is not a directory here (a hub id, another machine's path): the flags are still asked for
    fake_server.cards = [{"id": "served-a", "max_model_len": 64, "root": str(tmp_path / "elsewhere")}]
    rc, out, err = run_main(capsys, "--base-url", fake_server.base_url, "--random-input-len", "4",
                            "--random-output-len", "2")
    assert_one_line_error(rc, out, err, "need the vocabulary size for random prompts: pass --vocab-size N or "
                                        "--tokenizer CHECKPOINT_DIR (with config.json)")
