"""The OpenAI server's vLLM sampling fields on the real engine: penalties and min_tokens reach the
engine, echo + logprobs and prompt_logprobs score the prompt, and the model's generation config
gives the defaults of the fields a request leaves out (``max_new_tokens`` capping ``max_tokens``)."""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
from pathlib import Path

import httpx
import pytest

from launch import LLM, SamplingParams
from tests.server.test_server_live import LiveServer, runtime_config

PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def ckpt(tiny_ckpt_with_tokenizer: Path, tmp_path_factory) -> Path:
    """The tiny checkpoint with a generation config recommending greedy decoding and 16 tokens at most."""
    dst = tmp_path_factory.mktemp("gen") / "ckpt"
    shutil.copytree(tiny_ckpt_with_tokenizer, dst)
    path = dst / "generation_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "temperature": 0.0, "max_new_tokens": 16}))
    return dst


@pytest.fixture(scope="module")
def server(ckpt: Path, tmp_path_factory):
    with LiveServer(runtime_config(ckpt, tmp_path_factory.mktemp("dist"))) as srv:
        yield srv


@pytest.fixture(scope="module")
def offline(ckpt: Path):
    # max_logprobs=-1: logprobs=-1 / prompt_logprobs=-1 (the whole vocabulary) pass vLLM's --max-logprobs cap
    with LLM(str(ckpt), dtype="float32", max_model_len=96, num_kv_blocks=64, block_size=8, max_logprobs=-1) as llm:
        yield llm


def post(srv: LiveServer, path: str, body: dict) -> dict:
    r = httpx.post(srv.base_url + path, json={"model": srv.cfg.served_model_name, **body}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def test_generation_config_gives_the_defaults_and_caps_max_tokens(server: LiveServer, offline: LLM) -> None:
    ids = offline.get_tokenizer().encode(PROMPT)
    greedy = offline.generate([{"prompt_token_ids": ids}], SamplingParams(temperature=0.0, max_tokens=16,
                                                                           ignore_eos=True))[0].outputs[0]
    out = post(server, "/v1/completions", {"prompt": ids, "max_tokens": None, "ignore_eos": True})
    assert out["usage"]["completion_tokens"] == 16  # max_new_tokens, not the rest of the context
    assert out["choices"][0]["text"] == greedy.text  # temperature 0 from the generation config
    capped = post(server, "/v1/completions", {"prompt": ids, "max_tokens": 20, "ignore_eos": True})
    assert capped["usage"]["completion_tokens"] == 16  # vLLM: the generation config's max_new_tokens caps a request's
    chat = post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "ignore_eos": True})
    assert chat["usage"]["completion_tokens"] == 16


def test_penalties_and_min_tokens_reach_the_engine(server: LiveServer, offline: LLM) -> None:
    ids = offline.get_tokenizer().encode(PROMPT)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, repetition_penalty=1.8,
                            presence_penalty=0.5, frequency_penalty=0.7)
    want = offline.generate([{"prompt_token_ids": ids}], params)[0].outputs[0]
    plain = offline.generate([{"prompt_token_ids": ids}], SamplingParams(temperature=0.0, max_tokens=12,
                                                                          ignore_eos=True))[0].outputs[0]
    out = post(server, "/v1/completions", {"prompt": ids, "max_tokens": 12, "ignore_eos": True, "temperature": 0,
                                           "repetition_penalty": 1.8, "presence_penalty": 0.5,
                                           "frequency_penalty": 0.7})
    assert out["choices"][0]["text"] == want.text
    assert want.token_ids != plain.token_ids  # the penalties changed the greedy tokens here
    first = plain.token_ids[0]
    stopped = post(server, "/v1/completions", {"prompt": ids, "max_tokens": 4, "stop_token_ids": [first]})
    assert stopped["usage"]["completion_tokens"] == 1
    held = post(server, "/v1/completions", {"prompt": ids, "max_tokens": 4, "stop_token_ids": [first],
                                            "min_tokens": 3})
    assert held["usage"]["completion_tokens"] >= 3


def test_echo_with_logprobs_scores_the_prompt(server: LiveServer, offline: LLM) -> None:
    ids = offline.get_tokenizer().encode(PROMPT)
    want = offline.generate([{"prompt_token_ids": ids}], SamplingParams(temperature=0.0, max_tokens=1,
                                                                         prompt_logprobs=2))[0].prompt_logprobs
    out = post(server, "/v1/completions", {"prompt": ids, "max_tokens": 0, "echo": True, "logprobs": 2})
    choice = out["choices"][0]
    assert out["usage"]["completion_tokens"] == 0 and choice["finish_reason"] == "length"
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(ids) and lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    for q in range(1, len(ids)):
        assert lp["token_logprobs"][q] == pytest.approx(want[q][ids[q]], abs=1e-5)
        assert len(lp["top_logprobs"][q]) <= 3
    assert choice["text"] == offline.get_tokenizer().decode(ids, skip_special_tokens=True)
    scored = post(server, "/v1/completions", {"prompt": ids, "max_tokens": 2, "prompt_logprobs": 1,
                                              "ignore_eos": True})["choices"][0]
    assert scored["prompt_logprobs"][0] is None and len(scored["prompt_logprobs"]) == len(ids)
    for q in range(1, len(ids)):
        entry = scored["prompt_logprobs"][q]
        assert entry[str(ids[q])]["logprob"] == pytest.approx(want[q][ids[q]], abs=1e-5)
        assert sum(1 for e in entry.values() if e["rank"] == 1) == 1
    chat = post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
                                                 "prompt_logprobs": 0})
    assert chat["prompt_logprobs"][0] is None and len(chat["prompt_logprobs"]) == chat["usage"]["prompt_tokens"]


def test_logprob_ranks_are_over_the_whole_vocabulary(server: LiveServer, offline: LLM) -> None:
    """vLLM's ranks: the prompt token's (and the sampled token's) rank over the whole vocabulary, also
    where it is outside the top-n returned; logprobs=-1 / prompt_logprobs=-1 return every token."""
    ids = offline.get_tokenizer().encode(PROMPT)
    base = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    plain = offline.generate([{"prompt_token_ids": ids}], base)[0].outputs[0]
    full = offline.generate([{"prompt_token_ids": ids}], SamplingParams(
        temperature=0.0, max_tokens=3, ignore_eos=True, logprobs=-1, prompt_logprobs=-1))[0]
    few = offline.generate([{"prompt_token_ids": ids}], SamplingParams(
        temperature=0.0, max_tokens=3, ignore_eos=True, logprobs=0, prompt_logprobs=0))[0]
    vocab = len(full.prompt_logprobs[1])
    assert vocab == int(offline.engine.model_config.vocab_size) > 20
    assert full.outputs[0].token_ids == few.outputs[0].token_ids == plain.token_ids  # same greedy tokens
    want = [None] + [sum(lp >= e[t] for lp in e.values()) for t, e in zip(ids[1:], full.prompt_logprobs[1:])]
    assert full.prompt_logprob_ranks == few.prompt_logprob_ranks == want
    assert max(want[1:]) > 1  # some prompt token is outside the top-1
    for q in range(1, len(ids)):
        assert few.prompt_logprobs[q][ids[q]] == pytest.approx(full.prompt_logprobs[q][ids[q]], abs=1e-6)
    out = full.outputs[0]
    assert all(len(e) == vocab for e in out.logprobs)
    assert out.logprob_ranks == few.outputs[0].logprob_ranks == [
        sum(lp >= e[t] for lp in e.values()) for t, e in zip(out.token_ids, out.logprobs)]
    scored = post(server, "/v1/completions", {"prompt": ids, "max_tokens": 1, "prompt_logprobs": 0})
    ranks = [None if e is None else e[str(t)]["rank"] for t, e in zip(ids, scored["choices"][0]["prompt_logprobs"])]
    assert ranks == want  # was null for every prompt token outside the top-0
    echoed = post(server, "/v1/completions", {"prompt": ids, "max_tokens": 0, "echo": True, "logprobs": 1})
    assert len(echoed["choices"][0]["logprobs"]["tokens"]) == len(ids)


@pytest.mark.parametrize(("path", "body", "param", "message"), [
    ("/v1/completions", {"prompt_logprobs": -1}, "prompt_logprobs",
     r"Requested prompt logprobs of \d+, which is greater than max allowed: 20"),
    ("/v1/completions", {"prompt_logprobs": -2}, "prompt_logprobs", "or -1 for the whole vocabulary, got -2"),
    ("/v1/completions", {"logprobs": -1}, "logprobs", "greater than or equal to 0"),
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": -1}, "top_logprobs",
     r"Requested sample logprobs of \d+, which is greater than max allowed: 20"),
    ("/v1/chat/completions", {"top_logprobs": -1}, "top_logprobs", "top_logprobs requires logprobs=true"),
    ("/v1/chat/completions", {"prompt_logprobs": -1}, "prompt_logprobs", "Requested prompt logprobs of"),
])
def test_minus_one_logprobs_over_http_as_vllm(server: LiveServer, path: str, body: dict, param: str,
                                              message: str) -> None:
    """vLLM takes -1 (the whole vocabulary) for prompt_logprobs and chat top_logprobs, not for
    completions' logprobs; -1 counts as vocab_size against --max-logprobs (20, vLLM's default)."""
    base = {"prompt": PROMPT} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "hi"}]}
    r = httpx.post(server.base_url + path, json={"model": server.cfg.served_model_name, "max_tokens": 1, **base,
                                                 **body}, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and re.search(message, error["message"]), error
    assert "\n" not in error["message"]


def test_max_logprobs_flag_sets_the_servers_cap(ckpt: Path, tmp_path_factory) -> None:
    """``--max-logprobs 5`` (engine.max_logprobs) is the cap the server's 400s and the engine use, not
    vLLM's default 20: 5 alternatives are served, 6 are refused naming the request's field."""
    cfg = runtime_config(ckpt, tmp_path_factory.mktemp("dist"))
    cfg = dataclasses.replace(cfg, engine=dataclasses.replace(cfg.engine, max_logprobs=5))
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    with LiveServer(cfg) as srv:
        assert srv.engine.max_logprobs == 5
        ok = post(srv, "/v1/completions", {"prompt": PROMPT, "max_tokens": 2, "logprobs": 5, "prompt_logprobs": 5})
        scored = ok["choices"][0]["prompt_logprobs"]  # keyed by token id: texts may coincide, ids do not
        assert scored[0] is None and all(5 <= len(entry) <= 6 for entry in scored[1:])
        assert len(ok["choices"][0]["logprobs"]["tokens"]) == 2
        for path, body, param, kind in [
            ("/v1/completions", {"prompt": PROMPT, "logprobs": 6}, "logprobs", "sample"),
            ("/v1/completions", {"prompt": PROMPT, "prompt_logprobs": 6}, "prompt_logprobs", "prompt"),
            ("/v1/chat/completions", {**chat, "logprobs": True, "top_logprobs": 6}, "top_logprobs", "sample"),
        ]:
            r = httpx.post(srv.base_url + path, json={"model": srv.cfg.served_model_name, "max_tokens": 1, **body},
                           timeout=60)
            assert r.status_code == 400, r.text
            assert r.json()["error"] == {"message": f"Requested {kind} logprobs of 6, which is greater than max "
                                                    "allowed: 5", "type": "invalid_request_error", "param": param,
                                         "code": 400}
