"""``LLM.generate``: every prompt is checked before any is queued, a failed or interrupted call
leaves the engine as it was, prompt ids are checked like ``python -m launch generate`` checks
them, and the completions of a seeded request differ; ``LLM.chat`` renders conversations with
the checkpoint's chat template.

Runs the in-process engine on the session's tiny ``make-tiny`` checkpoint (vocab 512, no
tokenizer): a generate call takes well under a second.
"""

from __future__ import annotations

import pytest

from launch.core import SamplingParams
from launch.llm import LLM

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_ckpt):
    with LLM(str(tiny_ckpt), max_model_len=48, block_size=4, num_kv_blocks=40) as llm:
        yield llm


def _engine_state(llm: LLM) -> tuple:
    engine = llm.engine
    free = [a.num_free_blocks for a in engine.scheduler.allocators]
    return (engine.has_unfinished_requests(), free, engine.counters.prompt_tokens_total)


@pytest.mark.parametrize(("bad", "message"), [
    ({"prompt_token_ids": [5] * 49}, "prompt 1: prompt of 49 tokens exceeds max_model_len=48"),
    ({"prompt_token_ids": [5, 9999]}, r"prompt 1: token id 9999 is outside the vocabulary \[0, 512\)"),
    ({"prompt_token_ids": [5, 6.5]}, "prompt 1: 'prompt_token_ids' must be a non-empty list"),
])
def test_a_bad_prompt_queues_none_of_the_call(llm, bad, message):
    good = [{"prompt_token_ids": [5, 6, 7]}, {"prompt_token_ids": [9, 10]}]
    want = [o.outputs[0].token_ids for o in llm.generate(good, GREEDY)]
    before = _engine_state(llm)
    with pytest.raises(ValueError, match=f"^{message}"):
        llm.generate([good[0], bad, good[1]], GREEDY)
    assert _engine_state(llm) == before
    steps = llm.engine.counters.num_steps
    again = llm.generate(good, GREEDY)
    assert [o.outputs[0].token_ids for o in again] == want
    assert llm.engine.counters.num_steps - steps == 4  # 4 tokens each, in one batch: nothing else ran


def test_an_interrupted_generate_aborts_what_it_queued(llm, monkeypatch):
    prompts = [{"prompt_token_ids": [5, 6, 7]}, {"prompt_token_ids": [9, 10]}]
    want = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]
    before = _engine_state(llm)
    step = llm.engine.step
    calls = []

    def interrupted_step():
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return step()

    monkeypatch.setattr(llm.engine, "step", interrupted_step)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(prompts, GREEDY)
    monkeypatch.undo()
    unfinished, free, _ = _engine_state(llm)
    assert (unfinished, free) == before[:2]
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)] == want


@pytest.mark.parametrize(("prompt", "message"), [
    ({"prompt_token_ids": [5.9, 6.2]}, "'prompt_token_ids' must be a non-empty list of non-negative integers"),
    ({"prompt_token_ids": ["5", "6"]}, "'prompt_token_ids' must be a non-empty list of non-negative integers"),
    ({"prompt_token_ids": [True, 5]}, "'prompt_token_ids' must be a non-empty list of non-negative integers"),
    ({"prompt_token_ids": [[5, 6]]}, "'prompt_token_ids' must be a non-empty list of non-negative integers"),
    ({"prompt_token_ids": [-1, 5]}, "'prompt_token_ids' must be a non-empty list of non-negative integers"),
    ({"prompt_token_ids": []}, "'prompt_token_ids' must be a non-empty list of non-negative integers"),
    ({"prompt_token_ids": 5}, "'prompt_token_ids' must be a non-empty list of non-negative integers"),
    ({"prompt_token_ids": [5], "prompt": 3}, "'prompt' beside 'prompt_token_ids' must be a string, got int"),
    ({"prompt": None}, "'prompt' must be a string, got NoneType"),
    ({"prompt": ""}, "this checkpoint has no tokenizer.json"),  # "" is its bos alone, with a tokenizer
    ({"text": "hi"}, r"unknown prompt key\(s\) \['text'\]: a prompt dict holds 'prompt' and/or 'prompt_token_ids'"),
    ({"prompt": "hi", "max_tokens": 3}, r"unknown prompt key\(s\) \['max_tokens'\]: sampling fields \(max_tokens\) "
                                        "go in SamplingParams, not the prompt"),
    ({"prompt_token_ids": [5], "multi_modal_data": {}}, r"unknown prompt key\(s\) \['multi_modal_data'\]"),
    ({}, r"a prompt must be a string, .* got keys \[\]"),
    ([5, 6], "a prompt must be a string, .* got list"),
    ("hi", "this checkpoint has no tokenizer.json"),
    ({"prompt": "hi"}, "this checkpoint has no tokenizer.json"),
])
def test_prompts_are_checked_like_the_generate_cli(llm, prompt, message):
    before = _engine_state(llm)
    with pytest.raises(ValueError, match=f"^prompt 1: {message}"):
        llm.generate([{"prompt_token_ids": [3, 4]}, prompt], GREEDY)
    assert _engine_state(llm) == before


def test_token_ids_may_be_a_tuple_or_array_and_sampling_params_must_be_sampling_params(llm):
    import numpy as np
    import torch

    out = llm.generate({"prompt_token_ids": (3, 4)}, GREEDY)[0]
    assert out.prompt_token_ids == [3, 4] and len(out.outputs[0].token_ids) == 4
    # numpy / torch ids, as vLLM takes them
    for ids in (np.array([3, 4]), [np.int64(3), np.int32(4)], torch.tensor([3, 4])):
        again = llm.generate({"prompt_token_ids": ids}, GREEDY)[0]
        assert again.prompt_token_ids == [3, 4] and again.outputs[0].token_ids == out.outputs[0].token_ids
        assert all(type(t) is int for t in again.prompt_token_ids)
    with pytest.raises(ValueError, match="^sampling_params\\[1\\] must be a SamplingParams, got dict"):
        llm.generate([{"prompt_token_ids": [3]}, {"prompt_token_ids": [4]}], [GREEDY, {"max_tokens": 2}])
    for params in ({"max_tokens": 2}, "max_tokens"):  # one dict (or str): not a list of its keys (characters)
        with pytest.raises(ValueError, match=f"^sampling_params must be a SamplingParams or a list of them \\(one per "
                                             f"prompt\\), got {type(params).__name__}"):
            llm.generate({"prompt_token_ids": [3]}, params)
    for prompts in (5, None):  # not iterable: named, not "'int' object is not iterable"
        with pytest.raises(ValueError, match=f"^prompts must be a string, .* or a list of them, got "
                                             f"{type(prompts).__name__}$"):
            llm.generate(prompts, GREEDY)


def test_seeded_completions_differ_between_seeds_and_completions(llm):
    prompt = {"prompt_token_ids": [5, 6, 7, 8]}

    def tokens(**kwargs):
        params = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True, **kwargs)
        return [c.token_ids for c in llm.generate(prompt, params)[0].outputs]

    first, second = tokens(n=2, seed=-2)  # seeds -2 and -1
    assert first != second
    assert tokens(seed=0) != tokens(seed=2**61 - 1)
    assert tokens(n=2, seed=-2) == [first, second] and tokens(seed=-1) == [second]


def test_chat_renders_each_conversation_with_the_template_and_generates(tiny_ckpt_with_tokenizer, tiny_ckpt):
    """vLLM's LLM.chat: one conversation or several, rendered as the server renders a chat request
    (the template supplies bos; no second one), then generated as generate's prompts are."""
    hi = [{"role": "user", "content": "Hi"}]
    brief = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": [{"type": "text", "text": "a"},
                                                                                      {"type": "text", "text": "b"}]}]
    with LLM(str(tiny_ckpt_with_tokenizer), dtype="float32") as llm:
        tok = llm.get_tokenizer()
        one = llm.chat(hi, GREEDY)
        both = llm.chat([hi, brief], GREEDY)
        direct = llm.generate([{"prompt_token_ids": tok.encode_chat(c)} for c in (hi, brief)], GREEDY)
        assert one[0].prompt_token_ids == tok.encode_chat(hi) and one[0].prompt_token_ids.count(tok.bos_token_id) == 1
        assert one[0].prompt == tok.apply_chat_template(hi)
        assert [o.outputs[0].token_ids for o in both] == [o.outputs[0].token_ids for o in direct]
        assert both[0].outputs[0].token_ids == one[0].outputs[0].token_ids
        with pytest.raises(ValueError, match=r"^conversation 1: messages\[0\] must be a dict with a string 'role'"):
            llm.chat([hi, [{"content": "no role"}]], GREEDY)
        assert not llm.engine.has_unfinished_requests()
        with pytest.raises(ValueError, match="non-empty list"):
            llm.chat([], GREEDY)
    with LLM(str(tiny_ckpt), dtype="float32") as llm, pytest.raises(ValueError, match="tokenizer.json"):
        llm.chat(hi, GREEDY)


def test_use_tqdm_shows_the_calls_requests(llm, capsys):
    """vLLM's use_tqdm: a bar of this call's finished requests on stderr; none by default."""
    prompts = [{"prompt_token_ids": [5, 6]}, {"prompt_token_ids": [7]}]
    quiet = llm.generate(prompts, GREEDY)
    assert capsys.readouterr().err == ""
    shown = llm.generate(prompts, GREEDY, use_tqdm=True)
    err = capsys.readouterr().err
    assert "requests: 100%" in err and "2/2" in err
    assert [o.outputs[0].token_ids for o in shown] == [o.outputs[0].token_ids for o in quiet]
