"""vLLM's ``--max-logprobs`` (``engine.max_logprobs``, default 20, -1: the whole vocabulary): the flag
and config-file keys, ``LLM(max_logprobs=...)``, and the engine refusing a request whose sample or
prompt logprobs ask for more (-1 counting as vocab_size) with vLLM's message, before queueing anything.

vLLM reference: ``SamplingParams._validate_logprobs`` (vllm/sampling_params.py), ``ModelConfig.max_logprobs``
(vllm/config/model.py). The engine tests run the session's tiny ``make-tiny`` checkpoint (vocab 512).
"""

from __future__ import annotations

import pytest

from launch.config import ConfigError, RuntimeConfig
from launch.config_args import main as config_main
from launch.core import SamplingParams
from launch.core.sampling_params import max_logprobs_problem, params_max_logprobs_problem
from launch.llm import LLM, build_runtime_config
from launch.serve import build_parser, config_from_args

GREEDY = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)


# ---- the pure rule ---------------------------------------------------------------------------


@pytest.mark.parametrize(("num", "kind", "cap", "message"), [
    (None, "sample", 0, None),
    (0, "sample", 0, None),  # no alternatives: never over the cap (vLLM skips 0)
    (20, "sample", 20, None),
    (21, "sample", 20, "Requested sample logprobs of 21, which is greater than max allowed: 20"),
    (-1, "prompt", 20, "Requested prompt logprobs of 512, which is greater than max allowed: 20"),
    (-1, "sample", -1, None),  # -1 both sides: vocab_size against vocab_size
    (513, "prompt", -1, "Requested prompt logprobs of 513, which is greater than max allowed: 512"),
    (-1, "sample", 600, None),
])
def test_max_logprobs_problem_counts_minus_one_as_the_vocabulary(num, kind, cap, message):
    assert max_logprobs_problem(num, kind, cap, 512) == message


def test_sample_logprobs_are_checked_before_prompt_logprobs():
    params = SamplingParams(logprobs=5, prompt_logprobs=6)
    assert params_max_logprobs_problem(params, 4, 512) == (
        "Requested sample logprobs of 5, which is greater than max allowed: 4")
    assert params_max_logprobs_problem(SamplingParams(logprobs=4, prompt_logprobs=6), 4, 512) == (
        "Requested prompt logprobs of 6, which is greater than max allowed: 4")


# ---- configuration: flags, config files, LLM() -----------------------------------------------


def _serve_config(argv: list[str]) -> RuntimeConfig:
    return config_from_args(build_parser().parse_args(argv))


def test_default_flag_config_file_and_llm_keyword(tmp_path):
    assert RuntimeConfig(model="m").engine.max_logprobs == 20  # vLLM's default
    assert _serve_config(["ck", "--max-logprobs", "5"]).engine.max_logprobs == 5
    assert _serve_config(["ck", "--max-logprobs", "-1"]).engine.max_logprobs == -1
    flat, nested = tmp_path / "flat.yaml", tmp_path / "nested.yaml"
    flat.write_text("model: ck\nmax-logprobs: 7\n")  # vLLM's flat config file: flag names as keys
    nested.write_text("model: ck\nengine: {max_logprobs: 9}\n")
    assert _serve_config(["--config", str(flat)]).engine.max_logprobs == 7
    assert _serve_config(["--config", str(nested)]).engine.max_logprobs == 9
    assert _serve_config(["--config", str(nested), "--max-logprobs", "3"]).engine.max_logprobs == 3  # flag wins
    assert build_runtime_config("ck", {"max_logprobs": 50}).engine.max_logprobs == 50


@pytest.mark.parametrize(("argv", "message"), [
    (["--max-logprobs", "-2"], "error: engine: max_logprobs must be >= 0, or -1 for the whole vocabulary, got -2\n"),
    (["--max-logprobs", "many"], "error: argument --max-logprobs: invalid int value: 'many'"),
    (["--max-logprobs", "2.5"], "error: argument --max-logprobs: invalid int value: '2.5'"),
])
def test_bad_flag_values_are_one_line_errors(capsys, argv, message):
    try:
        rc = config_main(["--model", "ck", *argv])
    except SystemExit as e:  # argparse's type errors
        rc = e.code
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith(message) and err.count("\n") == 1, err


@pytest.mark.parametrize(("value", "match"), [
    (-3, "max_logprobs must be >= 0, or -1 for the whole vocabulary, got -3"),
    ("20", r"engine\.max_logprobs: expected int, found str"),
    (True, r"engine\.max_logprobs: expected int, found bool"),
])
def test_bad_config_values_name_the_key(value, match):
    with pytest.raises(ConfigError, match=match):
        RuntimeConfig.from_dict({"model": "m", "engine": {"max_logprobs": value}})
    with pytest.raises((ConfigError, ValueError), match=match.replace(r"engine\.", "")):
        build_runtime_config("m", {"max_logprobs": value})


# ---- the engine ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def llm(tiny_ckpt):
    with LLM(str(tiny_ckpt), max_model_len=48, block_size=4, num_kv_blocks=40, max_logprobs=3) as llm:
        yield llm


def _engine_state(llm: LLM) -> tuple:
    engine = llm.engine
    return (engine.has_unfinished_requests(), [a.num_free_blocks for a in engine.scheduler.allocators],
            engine.counters.prompt_tokens_total)


@pytest.mark.parametrize(("params", "message"), [
    (SamplingParams(max_tokens=2, logprobs=4), "Requested sample logprobs of 4, which is greater than max allowed: 3"),
    (SamplingParams(max_tokens=2, logprobs=-1), "Requested sample logprobs of 512, which is greater than max allowed: 3"),
    (SamplingParams(max_tokens=2, prompt_logprobs=4),
     "Requested prompt logprobs of 4, which is greater than max allowed: 3"),
    (SamplingParams(max_tokens=2, prompt_logprobs=-1),
     "Requested prompt logprobs of 512, which is greater than max allowed: 3"),
])
def test_generate_refuses_more_logprobs_than_the_cap_and_queues_none_of_the_call(llm, params, message):
    prompts = [{"prompt_token_ids": [5, 6, 7]}, {"prompt_token_ids": [9, 10]}]
    before = _engine_state(llm)
    with pytest.raises(ValueError, match=f"^prompt 1: {message}$"):
        llm.generate(prompts, [GREEDY, params])
    assert _engine_state(llm) == before
    with pytest.raises(ValueError, match=f"^request 'r1': {message}$"):
        llm.engine.add_request("r1", [5, 6, 7], params)
    assert _engine_state(llm) == before
    assert len(llm.generate(prompts, GREEDY)) == 2  # the engine still serves


def test_at_the_cap_is_served(llm):
    out = llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(
        temperature=0.0, max_tokens=2, ignore_eos=True, logprobs=3, prompt_logprobs=3))[0]
    assert all(3 <= len(entry) <= 4 for entry in out.outputs[0].logprobs)  # the top-3, and the sampled token
    assert out.prompt_logprobs[0] is None and all(3 <= len(e) <= 4 for e in out.prompt_logprobs[1:])


def test_minus_one_allows_the_whole_vocabulary(tiny_ckpt):
    with LLM(str(tiny_ckpt), max_model_len=48, block_size=4, num_kv_blocks=40, max_logprobs=-1) as llm:
        assert llm.engine.max_logprobs == -1
        out = llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(
            temperature=0.0, max_tokens=1, ignore_eos=True, logprobs=-1, prompt_logprobs=-1))[0]
        assert len(out.outputs[0].logprobs[0]) == len(out.prompt_logprobs[1]) == 512
        with pytest.raises(ValueError, match="^prompt 0: Requested sample logprobs of 513, which is greater than "
                                             "max allowed: 512$"):
            llm.generate([{"prompt_token_ids": [5]}], SamplingParams(max_tokens=1, logprobs=513))
