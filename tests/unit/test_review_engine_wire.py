"""Review: step messages whose history / release / prompt-span sections hold values past int32."""

from __future__ import annotations

from launch.core import BatchSpec, SamplingParams, ScheduledSequence
from launch.core.batch import HistoryChunk, PromptLogprobsSpan
from launch.core.wire import decode_batch, encode_batch


def _row(seq_id: int, params: SamplingParams) -> ScheduledSequence:
    return ScheduledSequence(request_id="r", seq_id=seq_id, index=0, token_ids=(5, 6, 7), positions=(0, 1, 2),
                             num_computed_tokens=0, block_ids=(0,), do_sample=True, params=params,
                             num_output_tokens=0)


def test_wire_carries_sequence_ids_past_int32():
    """Sequence ids only grow (one per completion): a server that has run 2**31 completions still
    sends its penalised rows' history chunks and releases intact."""
    big = 2**31 + 5
    params = SamplingParams(temperature=0.0, repetition_penalty=1.2)
    batch = BatchSpec(0, 16, (_row(big, params),), history=(HistoryChunk(0, big, 3),),
                      released_seq_ids=(big - 7, 2**40))
    wire = decode_batch(encode_batch(batch))
    assert wire.history == batch.history and wire.released_seq_ids == batch.released_seq_ids


def test_wire_takes_any_prompt_logprobs_count():
    """SamplingParams takes any prompt_logprobs >= 0 (the worker keeps at most the vocabulary): a huge
    one must not break the step message (the engine's step would raise for every request)."""
    params = SamplingParams(temperature=0.0, prompt_logprobs=2**40)
    batch = BatchSpec(0, 16, (_row(0, params),), prompt_logprobs=(PromptLogprobsSpan(0, 0, 2, 7, 2**40),))
    (span,) = decode_batch(encode_batch(batch)).prompt_logprobs
    assert (span.row, span.start, span.end, span.next_token_id) == (0, 0, 2, 7)
    assert span.num_logprobs >= 2**31 - 1  # still "all of them" to the worker
