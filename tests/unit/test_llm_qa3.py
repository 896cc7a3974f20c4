"""QA of the offline API against vLLM's ``LLM`` / ``SamplingParams`` / ``RequestOutput``: what a
script ported from vLLM reads and passes (``llm_engine``, ``CompletionOutput.finished()``,
``Logprob.logprob``, ``chat(continue_final_message=..., chat_template_kwargs=...)``,
``detokenize`` / ``skip_special_tokens`` / ``truncate_prompt_tokens``, positional ``use_tqdm``),
vLLM fields this engine cannot honour refused by name, and an LLM used after ``shutdown()``.

Runs the in-process engine on the session's tiny ``make-tiny`` checkpoint with its tokenizer.
"""

from __future__ import annotations

import pickle

import pytest

from launch import LLM, RequestOutputKind, SamplingParams
from launch.core.request import Sequence
from launch.tokenizer import Tokenizer

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
HI = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def llm(tiny_ckpt_with_tokenizer):
    with LLM(str(tiny_ckpt_with_tokenizer), dtype="float32", max_model_len=48) as llm:
        yield llm


def test_after_shutdown_every_call_is_a_clear_runtime_error(tiny_ckpt_with_tokenizer):
    llm = LLM(str(tiny_ckpt_with_tokenizer), dtype="float32", max_model_len=48)
    assert llm.llm_engine is llm.engine  # vLLM's name
    llm.shutdown()
    for call in (lambda: llm.generate("Hi", GREEDY), lambda: llm.chat(HI, GREEDY), llm.get_tokenizer):
        with pytest.raises(RuntimeError, match="^this LLM has been shut down"):
            call()
    llm.shutdown()  # twice is fine


def test_completion_finished_is_a_method_and_logprobs_read_as_vllm_logprob(llm):
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, logprobs=2, prompt_logprobs=1)
    out = llm.generate("Hi there", params)[0]
    c = out.outputs[0]
    assert c.finished() is True
    first = c.logprobs[0][c.token_ids[0]]
    assert first.logprob == first and first.rank == c.logprob_ranks[0] == 1 and first.decoded_token is None
    assert sorted(lp.rank for lp in c.logprobs[0].values()) == [1, 2]
    assert abs(sum(e[t] for e, t in zip(c.logprobs, c.token_ids)) - c.cumulative_logprob) < 1e-6
    scored = out.prompt_logprobs[1][out.prompt_token_ids[1]]
    assert scored.rank == out.prompt_logprob_ranks[1] and pickle.loads(pickle.dumps(scored)).rank == scored.rank


def test_use_tqdm_may_be_positional_and_params_per_prompt_must_match(llm):
    assert llm.generate("Hi", GREEDY, False)[0].outputs[0].token_ids == llm.generate("Hi", GREEDY)[0].outputs[0].token_ids
    with pytest.raises(ValueError, match="^2 prompts but 1 sampling params$"):
        llm.generate(["a", "b"], [GREEDY])


def test_chat_continue_final_message_and_template_kwargs(llm):
    convo = [*HI, {"role": "assistant", "content": "Sure, "}]
    out = llm.chat(convo, GREEDY, add_generation_prompt=False, continue_final_message=True)[0]
    assert out.prompt.endswith("<|assistant|>\nSure, ")
    assert out.prompt_token_ids == llm.get_tokenizer().encode(out.prompt, add_special_tokens=False)
    with pytest.raises(ValueError, match="continue_final_message=True needs add_generation_prompt=False"):
        llm.chat(convo, GREEDY, continue_final_message=True)
    own = "{% for m in messages %}[{{ m.content }}]{% endfor %}{{ tail }}"
    assert llm.chat(HI, GREEDY, chat_template=own, chat_template_kwargs={"tail": "!"})[0].prompt == "[Hi]!"
    with pytest.raises(ValueError, match="chat_template_kwargs may not set 'messages'"):
        llm.chat(HI, GREEDY, chat_template_kwargs={"messages": []})


def test_truncate_prompt_tokens_keeps_the_last_ids(llm):
    ids = list(range(10, 70))  # longer than max_model_len=48
    cut = llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0.0, max_tokens=2, truncate_prompt_tokens=5))
    assert cut[0].prompt_token_ids == ids[-5:]
    whole = llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0.0, max_tokens=None,
                                                                   truncate_prompt_tokens=-1, ignore_eos=True))
    assert whole[0].prompt_token_ids == ids[-48:] and whole[0].outputs[0].finish_reason == "length"


def test_detokenize_false_gives_ids_without_text(llm):
    out = llm.generate("Hi", SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, detokenize=False))[0]
    assert out.outputs[0].text == "" and out.outputs[0].token_ids == llm.generate("Hi", GREEDY)[0].outputs[0].token_ids


def test_skip_special_tokens_false_keeps_them_in_the_text(tiny_ckpt_with_tokenizer):
    tok = Tokenizer.from_dir(tiny_ckpt_with_tokenizer)
    user = tok.token_to_id("<|user|>")
    texts = []
    for skip in (True, False):
        seq = Sequence(0, "r", 0, tok.encode("Hi"), SamplingParams(skip_special_tokens=skip), 64, 0, decode=tok.decode)
        seq.append_token(user)
        texts.append(seq.output_text)
    assert texts == ["", "<|user|>"]


@pytest.mark.parametrize(("fields", "message"), [
    (dict(logit_bias={5: float("nan")}), "^logit_bias values must be finite numbers"),
    (dict(logit_bias={"5": 1.0}), "^logit_bias keys must be token ids"),
    (dict(logit_bias=[5, 1.0]), "^logit_bias must map token ids"),
    (dict(allowed_token_ids=[5, -1]), "^allowed_token_ids must be a list of token ids"),
    (dict(bad_words=["x", " "]), "^bad_words must be a list of non-blank strings"),
    (dict(logits_processors=[print]), "^logits_processors is not supported"),
    (dict(best_of=3), r"^best_of=3 is not supported"),
    (dict(truncate_prompt_tokens=0), "^truncate_prompt_tokens must be"),
    (dict(stop="x", detokenize=False), "^stop strings need detokenize=True"),
    (dict(output_kind=7), "^output_kind must be a RequestOutputKind"),
    (dict(skip_special_tokens=None), "^skip_special_tokens must be a bool"),
])
def test_vllm_fields_this_engine_cannot_honour_are_refused_by_name(fields, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**fields)


def test_vllm_no_op_values_are_taken():
    p = SamplingParams(n=2, best_of=2, logit_bias={}, bad_words=[], output_kind=RequestOutputKind.FINAL_ONLY,
                       spaces_between_special_tokens=False)
    assert p.logit_bias is None and p.bad_words is None and hash(p) == hash(SamplingParams(**vars(p)))
    assert p.for_sample(1).best_of is None and SamplingParams(output_kind=1).output_kind is RequestOutputKind.DELTA


def test_vllm_constructor_no_ops_are_taken_and_a_foreign_tokenizer_is_refused(tiny_ckpt):
    from launch.llm import build_runtime_config

    cfg = build_runtime_config(str(tiny_ckpt), dict(tokenizer=str(tiny_ckpt), disable_log_stats=True,
                                                    trust_remote_code=True, tokenizer_mode="auto"))
    assert cfg == build_runtime_config(str(tiny_ckpt), {})
    with pytest.raises(TypeError, match="^LLM\\(\\) tokenizer_mode='slow' is not supported: only 'auto'"):
        build_runtime_config(str(tiny_ckpt), dict(tokenizer_mode="slow"))
    with pytest.raises(TypeError, match="^LLM\\(\\) tokenizer='/elsewhere' is not supported"):
        build_runtime_config(str(tiny_ckpt), dict(tokenizer="/elsewhere"))
    with pytest.raises(TypeError, match="^LLM\\(\\) got an unexpected keyword argument 'swap_space'$"):
        build_runtime_config(str(tiny_ckpt), dict(swap_space=4))
