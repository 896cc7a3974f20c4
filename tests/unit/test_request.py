"""SamplingParams validation, incremental detokenization, stop conditions on a Sequence."""

from __future__ import annotations

import pytest

from launch.core.detokenizer import IncrementalDetokenizer, find_stop_string
from launch.core.request import Sequence, SequenceStatus
from launch.core.sampling_params import SamplingParams


def byte_decode(ids: list[int]) -> str:
    """A byte-level tokenizer: one token per UTF-8 byte."""
    return bytes(ids).decode("utf-8", errors="replace")


def make_seq(params: SamplingParams, prompt: list[int] | None = None, max_model_len: int = 100,
             eos: tuple[int, ...] = (0,)) -> Sequence:
    return Sequence(seq_id=0, request_id="r", index=0, prompt_token_ids=prompt or list(b"hi "), params=params,
                    max_model_len=max_model_len, arrival_order=0, eos_token_ids=eos, decode=byte_decode)


def feed(seq: Sequence, text: str) -> list[str]:
    shown = []
    for b in text.encode():
        if seq.append_token(b):
            break
        shown.append(seq.visible_text())
    return shown


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [({"n": 0}, "n must"), ({"temperature": -0.1}, "temperature"), ({"top_p": 0.0}, "top_p"),
     ({"top_p": 1.5}, "top_p"), ({"top_k": -2}, "top_k"), ({"max_tokens": 0}, "max_tokens"),
     ({"stop": ["ok", ""]}, "stop strings"), ({"stop_token_ids": [-1]}, "stop_token_ids"),
     ({"seed": 1.5}, "seed"), ({"logprobs": -2}, "logprobs"), ({"max_tokens": True}, "max_tokens"),
     ({"seed": 2**63}, r"^seed must be None or an integer in \[-2\*\*63, 2\*\*63 - 1\] \(int64\), got 9223372036854775808$"),
     ({"seed": -(2**63) - 1}, r"in \[-2\*\*63, 2\*\*63 - 1\] \(int64\)")],
)
def test_sampling_params_reject_bad_values(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_sampling_params_normalise_and_derive():
    p = SamplingParams(stop="###", stop_token_ids=[5], temperature=0.0, n=3, seed=10, top_k=0)
    assert p.stop == ("###",) and p.stop_token_ids == (5,) and p.is_greedy and not p.top_k_enabled
    assert hash(p) == hash(SamplingParams(stop=["###"], stop_token_ids=(5,), temperature=0.0, n=3, seed=10, top_k=0))
    child = p.for_sample(2)
    assert child.n == 1 and child.seed == 12 and child.stop == ("###",)
    assert SamplingParams(n=2).for_sample(1).seed is None
    with pytest.raises(ValueError, match="out of range"):
        p.for_sample(3)
    assert SamplingParams().max_tokens == 16 and SamplingParams().temperature == 1.0


def test_completion_seeds_wrap_within_int64():
    """seed + index stays an accepted (int64) seed at the top of the range, and the n seeds differ."""
    top = SamplingParams(n=3, seed=2**63 - 1)
    assert [top.for_sample(i).seed for i in range(3)] == [2**63 - 1, -(2**63), -(2**63) + 1]
    assert [SamplingParams(n=2, seed=-2).for_sample(i).seed for i in range(2)] == [-2, -1]


def test_incremental_detokenizer_waits_for_complete_characters():
    detok = IncrementalDetokenizer(byte_decode, list(b"abc"))
    pieces = [detok.add_token(b) for b in "é!".encode()]
    assert pieces == ["", "é", "!"]


def test_find_stop_string_only_in_new_tail_and_earliest():
    assert find_stop_string("abcSTOPxy", 2, ["STOP"], False) is None  # already searched
    assert find_stop_string("abcSTO", 1, ["STOP"], False) is None
    assert find_stop_string("abcSTOP", 1, ["STOP"], False) == ("STOP", 3)
    assert find_stop_string("abcSTOP", 1, ["STOP"], True) == ("STOP", 7)
    assert find_stop_string("xAB", 2, ["B", "AB"], False) == ("AB", 1)


def test_stop_string_trimmed_and_streaming_holds_back_prefix():
    seq = make_seq(SamplingParams(max_tokens=50, stop=["END"]))
    shown = feed(seq, "good ENough END tail")
    assert seq.status is SequenceStatus.FINISHED_STOPPED and seq.stop_reason == "END"
    assert seq.output_text == "good ENough " and seq.visible_text() == "good ENough "
    assert "good E" not in shown and "good " in shown  # "E" then "EN" held back until disproved
    assert all("END" not in s for s in shown)
    out = seq.to_completion_output()
    assert out.finish_reason == "stop" and out.text == "good ENough " and len(out.token_ids) == len("good ENough END")


def test_include_stop_str_in_output():
    seq = make_seq(SamplingParams(max_tokens=50, stop=["!"], include_stop_str_in_output=True))
    feed(seq, "wow! more")
    assert seq.output_text == "wow!" and seq.stop_reason == "!"


def test_eos_ignore_eos_and_stop_token_ids():
    seq = make_seq(SamplingParams(max_tokens=10))
    assert not seq.append_token(ord("a")) and seq.append_token(0)
    assert seq.to_completion_output().finish_reason == "stop" and seq.stop_reason is None
    assert seq.output_text == "a"  # EOS is kept in token_ids but not detokenized
    keep_going = make_seq(SamplingParams(max_tokens=10, ignore_eos=True))
    assert not keep_going.append_token(0) and not keep_going.is_finished
    by_id = make_seq(SamplingParams(max_tokens=10, stop_token_ids=[ord("z")]))
    assert by_id.append_token(ord("z")) and by_id.stop_reason == ord("z") and by_id.output_text == ""


def test_length_limits():
    seq = make_seq(SamplingParams(max_tokens=3))
    assert [seq.append_token(ord(c)) for c in "abc"] == [False, False, True]
    assert seq.status is SequenceStatus.FINISHED_LENGTH_CAPPED and seq.to_completion_output().finish_reason == "length"
    capped = make_seq(SamplingParams(max_tokens=None), prompt=[ord("x")] * 5, max_model_len=7)
    assert [capped.append_token(ord("y")) for _ in range(2)] == [False, True]
    assert capped.max_num_tokens == 7 and capped.num_tokens == 7


def test_logprobs_accumulate_only_when_requested():
    seq = make_seq(SamplingParams(max_tokens=5, logprobs=1))
    seq.append_token(ord("a"), {ord("a"): -0.5, ord("b"): -1.0})
    seq.append_token(ord("b"), {ord("b"): -0.25})
    out = seq.to_completion_output()
    assert out.cumulative_logprob == pytest.approx(-0.75) and len(out.logprobs) == 2
    plain = make_seq(SamplingParams(max_tokens=5))
    plain.append_token(ord("a"), {ord("a"): -0.5})
    assert plain.to_completion_output().logprobs is None and plain.cumulative_logprob is None


def test_token_slice_spans_prompt_and_outputs():
    seq = make_seq(SamplingParams(max_tokens=10), prompt=[1, 2, 3])
    for t in (4, 5, 6):
        seq.append_token(t)
    assert seq.token_slice(0, 6) == [1, 2, 3, 4, 5, 6] == seq.token_ids
    assert seq.token_slice(2, 5) == [3, 4, 5] and seq.token_slice(4, 6) == [5, 6] and seq.token_slice(0, 2) == [1, 2]
