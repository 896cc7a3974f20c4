"""QA against vLLM's SamplingParams and stop semantics: validation that names the field, and the
text of a stop token with include_stop_str_in_output (pure: no model)."""

from __future__ import annotations

import math

import pytest

from launch.core.request import Sequence
from launch.core.sampling_params import SamplingParams


def byte_decode(ids: list[int]) -> str:
    """One token per UTF-8 byte."""
    return bytes(ids).decode("utf-8", errors="replace")


def make_seq(params: SamplingParams) -> Sequence:
    return Sequence(seq_id=0, request_id="r", index=0, prompt_token_ids=list(b"hi "), params=params,
                    max_model_len=100, arrival_order=0, eos_token_ids=(0,), decode=byte_decode)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"temperature": math.inf}, r"^temperature must be a finite number >= 0, got inf$"),
    ({"temperature": math.nan}, r"^temperature must be a finite number >= 0, got nan$"),
    ({"stop": 5}, r"^stop must be a string or a list of strings, got 5$"),
    ({"stop": {"a": 1}}, r"^stop must be a string or a list of strings"),
    ({"stop_token_ids": 5}, r"^stop_token_ids must be a list of non-negative integers, got 5$"),
    ({"ignore_eos": "no"}, r"^ignore_eos must be a bool, got 'no'$"),
    ({"include_stop_str_in_output": 1}, r"^include_stop_str_in_output must be a bool, got 1$"),
    ({"top_p": True}, r"^top_p must be in \(0, 1\], got True$"),
])
def test_bad_values_raise_one_line_naming_the_field(kwargs, message):
    """vLLM refuses a non-finite temperature; a truthy string must not switch ignore_eos on; a
    scalar where a list belongs is a ValueError naming the field, not "'int' object is not
    iterable"."""
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_valid_containers_still_normalise():
    p = SamplingParams(stop=("a", "b"), stop_token_ids=[3], ignore_eos=True, include_stop_str_in_output=False)
    assert p.stop == ("a", "b") and p.stop_token_ids == (3,)
    assert SamplingParams(stop="x", stop_token_ids=None).stop == ("x",)


@pytest.mark.parametrize(("include", "text"), [(False, "ok"), (True, "ok!")])
def test_stop_token_text_follows_include_stop_str_in_output(include, text):
    """vLLM detokenizes the stop token itself when include_stop_str_in_output is set (its
    Detokenizer.update skips the last token only without it); token_ids keep it either way."""
    seq = make_seq(SamplingParams(max_tokens=10, stop_token_ids=[ord("!")], include_stop_str_in_output=include))
    for t in b"ok!":
        finished = seq.append_token(t)
    out = seq.to_completion_output()
    assert finished and out.finish_reason == "stop" and out.stop_reason == ord("!")
    assert out.text == text and out.token_ids == list(b"ok!")


# ---- log-probability ranks over the whole vocabulary, and logprobs=-1 (vLLM) -------------------


def test_logprobs_minus_one_is_the_whole_vocabulary_and_below_is_refused():
    """vLLM's SamplingParams: "When set to -1, return all vocab_size log probabilities" (logprobs and
    prompt_logprobs); below -1 is refused, naming the field."""
    assert SamplingParams(logprobs=-1, prompt_logprobs=-1).logprobs == -1
    for name in ("logprobs", "prompt_logprobs"):
        with pytest.raises(ValueError, match=rf"^{name} must be None, an integer >= 0 or -1 .*got -2$"):
            SamplingParams(**{name: -2})


def test_prompt_token_rank_is_over_the_whole_vocabulary_outside_the_top_n():
    """The scored prompt token's rank is 1 + the tokens likelier than it, even where it is not among
    the top-n returned (vLLM's ``Logprob.rank``), and -1 returns every token's logprob."""
    import torch

    from launch.core.token_history import gather_logprobs

    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0], [0.0, 1.0, 2.0, 3.0, 4.0]])
    entries, ranks = gather_logprobs(logits, torch.tensor([3, 4]), [1, -1])
    assert ranks == [4, 1]
    assert list(entries[0]) == [3, 0]  # the prompt token, then the top-1
    assert sorted(entries[1]) == [0, 1, 2, 3, 4]
    lp = logits.log_softmax(-1)
    assert all(entries[1][t] == pytest.approx(lp[1, t].item()) for t in range(5))


def test_sampled_token_rank_is_over_the_whole_vocabulary_on_every_transport():
    """A sampled token's rank (``CompletionOutput.logprob_ranks``) counts the whole vocabulary,
    whatever ``logprobs`` asked for; the fast step transport carries the ranks unchanged."""
    import torch

    from launch.core.batch import SampledTokens
    from launch.core.sampler import Sampler
    from launch.worker import StepResult

    torch.manual_seed(0)
    logits = torch.randn(6, 50)
    params = [SamplingParams(temperature=5.0, seed=s, logprobs=n) for s, n in enumerate([0, 1, 2, -1, None, 0])]
    out = Sampler(seed=0)(logits, params, list(range(6)))
    sampled = out.to_sampled_tokens(params)
    lp = logits.log_softmax(-1)
    for b, t in enumerate(sampled.token_ids):
        want = int((lp[b] >= lp[b, t]).sum())
        assert sampled.logprob_ranks[b] == (None if params[b].logprobs is None else want)
    assert max(sampled.logprob_ranks[b] for b in (0, 1, 2, 3, 5)) > 1  # some draw is not the argmax
    assert len(sampled.logprobs[3]) == 50 and len(sampled.logprobs[0]) == 1
    sampled.prompt_logprobs, sampled.prompt_logprob_ranks = [[{3: -1.5, 0: -0.1}]], [[7]]
    back = StepResult.from_bytes(StepResult(sampled).to_bytes()).sampled
    assert back.logprob_ranks == sampled.logprob_ranks and back.prompt_logprob_ranks == [[7]]
    assert back.logprobs == sampled.logprobs and isinstance(back, SampledTokens)


def test_sequence_keeps_ranks_beside_logprobs():
    seq = Sequence(seq_id=0, request_id="r", index=0, prompt_token_ids=list(b"hi "),
                   params=SamplingParams(max_tokens=5, logprobs=0, prompt_logprobs=0), max_model_len=100,
                   arrival_order=0, eos_token_ids=(0,), decode=byte_decode)
    seq.add_prompt_logprobs(0, [{ord("i"): -3.0}, {ord(" "): -2.0}], [9, 4])
    seq.append_token(ord("a"), {ord("a"): -0.5}, 2)
    assert seq.prompt_logprob_ranks == [None, 9, 4]
    assert seq.to_completion_output().logprob_ranks == [2]


def test_server_prompt_logprobs_rank_the_prompt_token_outside_the_top_n():
    """vLLM's prompt_logprobs entry: the prompt token's rank over the whole vocabulary (was null
    when it was not among the top-n); the top-n keep their places."""
    from types import SimpleNamespace

    from launch.server.formatting import CompletionFormatter

    fmt = CompletionFormatter(request_id="r", model="m", prompts=[[5, 6, 7]], n=1, token_text=str, num_logprobs=None,
                              prompt_logprobs=1)
    out = SimpleNamespace(prompt_token_ids=[5, 6, 7], prompt_logprobs=[None, {6: -4.0, 2: -0.1}, {7: -0.2, 1: -3.0}],
                          prompt_logprob_ranks=[None, 12, 1])
    scored = fmt.prompt_logprobs_of(out, 1)
    assert scored[0] is None
    assert {t: e.rank for t, e in scored[1].items()} == {6: 12, 2: 1}
    assert {t: e.rank for t, e in scored[2].items()} == {7: 1}
    every = fmt.prompt_logprobs_of(SimpleNamespace(prompt_token_ids=[5, 6], prompt_logprobs=[None, {6: -4.0, 2: -0.1,
                                                   3: -0.5}], prompt_logprob_ranks=[None, 3]), -1)
    assert {t: e.rank for t, e in every[1].items()} == {6: 3, 2: 1, 3: 2}
