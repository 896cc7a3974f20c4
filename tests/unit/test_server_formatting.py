"""launch/server/formatting.py: streamed chunks say what the whole response says."""

from __future__ import annotations

import json
from types import SimpleNamespace

from launch.server.formatting import ChatFormatter, CompletionFormatter

# token 2 is the first byte of a character that token 3 completes: its own text is U+FFFD, and the
# engine's cumulative text holds the character back until token 3 arrives
TOKEN_TEXT = {1: "a", 2: "\ufffd", 3: "\ufffd", 4: "b"}
STEPS = [([1], "a"), ([1, 2], "a"), ([1, 2, 3], "a\u00e9"), ([1, 2, 3, 4], "a\u00e9b")]


def _out(ids: list[int], text: str, done: bool) -> SimpleNamespace:
    c = SimpleNamespace(text=text, token_ids=ids, logprobs=[{t: -1.0} for t in ids],
                        finish_reason="length" if done else None, stop_reason=None)
    return SimpleNamespace(outputs=[c])


def _formatter(cls):
    return cls(request_id="r", model="m", prompts=[[5]], n=1, token_text=TOKEN_TEXT.__getitem__, num_logprobs=1)


def test_streamed_text_offsets_equal_the_whole_responses_across_a_split_character() -> None:
    stream = _formatter(CompletionFormatter)
    offsets, text = [], ""
    for i, (ids, cumulative) in enumerate(STEPS):
        for chunk in stream.stream_chunks(0, _out(ids, cumulative, i == len(STEPS) - 1)):
            (choice,) = chunk.choices
            offsets += choice.logprobs.text_offset
            text += choice.text
    whole = _formatter(CompletionFormatter).response([_out(*STEPS[-1], True)]).choices[0]
    assert whole.logprobs.text_offset == [0, 1, 2, 3]
    assert offsets == whole.logprobs.text_offset and text == whole.text == "a\u00e9b"


def test_chat_deltas_carry_only_their_keys() -> None:
    chat = _formatter(ChatFormatter)
    (first,) = chat.stream_start()
    assert json.loads(first.model_dump_json())["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    deltas = [json.loads(chunk.model_dump_json())["choices"][0]["delta"]
              for i, (ids, cumulative) in enumerate(STEPS)
              for chunk in chat.stream_chunks(0, _out(ids, cumulative, i == len(STEPS) - 1))]
    # the held-back byte's chunk (logprobs asked for) and nothing else carries no content key
    assert deltas == [{"content": "a"}, {}, {"content": "\u00e9"}, {"content": "b"}]


def test_completion_top_logprobs_keep_the_sampled_token_past_the_top_n() -> None:
    """OpenAI's completions: the sampled token's logprob is always there, so up to logprobs + 1 entries."""
    fmt = _formatter(CompletionFormatter)  # num_logprobs=1
    lp = fmt.logprobs([4, 1], [{4: -2.0, 1: -0.1, 3: -1.0}, {1: -0.2, 4: -3.0}], 0)
    assert lp.top_logprobs == [{"a": -0.1, "b": -2.0}, {"a": -0.2}]  # sampled b below the top 1: added
    assert lp.token_logprobs == [-2.0, -0.2]


def test_the_last_chat_chunk_says_which_stop_ended_the_choice_as_the_whole_response_does() -> None:
    def stopped(ids: list[int], text: str, done: bool) -> SimpleNamespace:
        out = _out(ids, text, done)
        out.outputs[0].finish_reason, out.outputs[0].stop_reason = ("stop", "b") if done else (None, None)
        return out

    chat = _formatter(ChatFormatter)
    chunks = [json.loads(chunk.model_dump_json())["choices"][0]
              for i, (ids, cumulative) in enumerate(STEPS)
              for chunk in chat.stream_chunks(0, stopped(ids, cumulative, i == len(STEPS) - 1))]
    whole = _formatter(ChatFormatter).response([stopped(*STEPS[-1], True)]).choices[0]
    assert (chunks[-1]["finish_reason"], chunks[-1]["stop_reason"]) == ("stop", "b") == \
        (whole.finish_reason, whole.stop_reason)
    assert all(c["stop_reason"] is None for c in chunks[:-1])
