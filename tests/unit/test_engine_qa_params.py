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
