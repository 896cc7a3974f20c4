"""Requests and their sequences: the scheduler's unit of work.

A ``Request`` is what a client sent (one prompt, one ``SamplingParams``); it owns
``n`` ``Sequence`` objects, one per completion. Sequences are what the scheduler
schedules and the block allocator gives KV blocks to. A sequence's tokens are its
prompt followed by its outputs; ``num_computed_tokens`` of them have KV in the cache.
After preemption (recomputation) a sequence restarts at ``num_computed_tokens == 0``
and recomputes prompt + outputs as one longer prompt; its outputs are never lost.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from launch.core.detokenizer import DecodeFn, IncrementalDetokenizer, find_stop_string, stop_string_holdback
from launch.core.outputs import (
    CompletionOutput,
    FinishReason,
    RequestMetrics,
    RequestOutput,
    TokenLogprobs,
    as_logprobs,
)
from launch.core.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH_CAPPED = "finished_length_capped"
    FINISHED_ABORTED = "finished_aborted"
    FINISHED_ERROR = "finished_error"

    @property
    def is_finished(self) -> bool:
        return self in _FINISH_REASONS

    @property
    def finish_reason(self) -> FinishReason | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS: dict[SequenceStatus, FinishReason] = {
    SequenceStatus.FINISHED_STOPPED: "stop",
    SequenceStatus.FINISHED_LENGTH_CAPPED: "length",
    SequenceStatus.FINISHED_ABORTED: "abort",
    SequenceStatus.FINISHED_ERROR: "error",
}


@dataclass(eq=False)
class Sequence:
    """One completion being generated.

    Invariants: ``0 <= num_computed_tokens <= num_tokens``; ``block_ids`` hold at least
    ``num_computed_tokens`` token slots while the sequence is running and are empty once
    it is waiting, preempted or finished; ``block_hashes[i]`` is the chained hash of
    full block i of the token ids (filled lazily by the allocator).
    """

    seq_id: int
    request_id: str
    index: int
    prompt_token_ids: list[int]
    params: SamplingParams
    max_model_len: int
    arrival_order: int
    # The first is the tokenizer's EOS (stop_reason None); the others (generation_config.json's extra ids)
    # end with stop_reason = the id, as vLLM's update_from_generation_config adds them to stop_token_ids.
    eos_token_ids: tuple[int, ...] = ()
    dp_rank: int = 0
    decode: DecodeFn | None = None
    status: SequenceStatus = SequenceStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    block_ids: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)
    output_text: str = ""
    logprobs: list[TokenLogprobs] | None = None
    logprob_ranks: list[int | None] | None = None  # beside logprobs: each sampled token's vocabulary rank
    cumulative_logprob: float | None = None
    stop_reason: str | int | None = None
    finish_reason: FinishReason | None = None
    num_cached_blocks: int = 0  # leading block_ids already registered in (or shadowed by) the prefix cache
    # per prompt token: None for the first, then its logprob entry (``PromptLogprobsSpan``); only the
    # first completion of a request collects them (its siblings may read the prompt from the cache)
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    prompt_logprob_ranks: list[int | None] | None = None  # beside prompt_logprobs: each prompt token's rank
    keeps_history: bool = field(init=False, default=False)  # params.keeps_history, read per row per step

    def __post_init__(self) -> None:
        self._detokenizer = None if self.decode is None or not self.params.detokenize \
            else IncrementalDetokenizer(_decode_for(self.decode, self.params), self.prompt_token_ids)
        if self.params.logprobs is not None:
            self.logprobs, self.logprob_ranks, self.cumulative_logprob = [], [], 0.0
        self.keeps_history = self.params.keeps_history
        if self.params.prompt_logprobs is not None and self.index == 0:
            self.prompt_logprobs, self.prompt_logprob_ranks = [None], [None]

    # ---- sizes ---------------------------------------------------------------------

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def token_ids(self) -> list[int]:
        """Prompt followed by outputs (a new list)."""
        return self.prompt_token_ids + self.output_token_ids

    def token_slice(self, start: int, end: int) -> list[int]:
        """Token ids ``[start, end)`` of prompt + outputs without copying the whole sequence."""
        p = len(self.prompt_token_ids)
        if end <= p:
            return self.prompt_token_ids[start:end]
        if start >= p:
            return self.output_token_ids[start - p : end - p]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - p]

    @property
    def max_num_tokens(self) -> int:
        """Length this sequence can reach: prompt + max_tokens, capped by max_model_len."""
        cap = self.max_model_len
        if self.params.max_tokens is not None:
            cap = min(cap, self.num_prompt_tokens + self.params.max_tokens)
        return cap

    @property
    def num_outstanding_tokens(self) -> int:
        """Tokens still to run through the model at most (uncomputed + yet to generate)."""
        return 0 if self.is_finished else max(0, self.max_num_tokens - self.num_computed_tokens)

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None

    # ---- prompt logprobs -----------------------------------------------------------

    @property
    def needs_prompt_logprobs(self) -> bool:
        """True while prompt positions remain to be scored (it then skips the prefix cache)."""
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) < len(self.prompt_token_ids)

    def prompt_logprobs_span(self, start: int, end: int) -> tuple[int, int, int] | None:
        """For a chunk of positions [start, end) computed this step: the positions [first, last) whose
        logits score prompt tokens not scored yet, and the prompt token at ``last`` (scored by position
        last - 1); None when the chunk holds none. A chunk recomputed after a preemption skips the
        positions already scored, so no entry is added twice."""
        if not self.needs_prompt_logprobs:
            return None
        first = max(start, len(self.prompt_logprobs) - 1)
        last = min(end, len(self.prompt_token_ids) - 1)
        return (first, last, self.prompt_token_ids[last]) if first < last else None

    def add_prompt_logprobs(self, first: int, entries: list[TokenLogprobs],
                            ranks: list[int] | None = None) -> None:
        """Entries (and the scored tokens' vocabulary ranks, None when unknown) for the prompt tokens
        at positions first + 1 ...; ignored unless they are the next ones missing (a stale reply
        cannot add an entry twice)."""
        if self.prompt_logprobs is not None and len(self.prompt_logprobs) == first + 1:
            room = len(self.prompt_token_ids) - len(self.prompt_logprobs)
            ranks = (ranks or [None] * len(entries))[:min(room, len(entries))]
            at = len(self.prompt_logprobs)
            self.prompt_logprobs.extend(as_logprobs(e, self.prompt_token_ids[at + i], r)
                                        for i, (e, r) in enumerate(zip(entries[:room], ranks)))
            self.prompt_logprob_ranks.extend(ranks)

    # ---- generation ----------------------------------------------------------------

    def append_token(self, token_id: int, logprobs: TokenLogprobs | None = None, rank: int | None = None) -> bool:
        """Append one sampled token, extend the text and check every stop condition.

        EOS (unless ignore_eos) and stop token ids end the sequence with "stop" and are
        kept in token_ids; their text is added only with include_stop_str_in_output (as vLLM:
        an EOS, a special token, then usually adds nothing). Before ``min_tokens`` outputs exist
        neither ends it (the sampler masks them then; vLLM's ``check_stop`` skips them too).
        ``rank``: the token's rank over the vocabulary, beside ``logprobs`` (None when unknown).
        Returns True if the sequence finished.
        """
        token_id = int(token_id)
        self.output_token_ids.append(token_id)
        if self.logprobs is not None and logprobs is not None:
            self.logprobs.append(as_logprobs(logprobs, token_id, rank))
            self.logprob_ranks.append(rank)
            self.cumulative_logprob = (self.cumulative_logprob or 0.0) + float(logprobs.get(token_id, 0.0))
        params = self.params
        if not params.min_tokens or len(self.output_token_ids) >= params.min_tokens:
            if not params.ignore_eos and token_id in self.eos_token_ids:
                self._stop_on_token(token_id, None if token_id == self.eos_token_ids[0] else token_id)
                return True
            if token_id in params.stop_token_ids:
                self._stop_on_token(token_id, token_id)
                return True
        new_text = self._detokenizer.add_token(token_id) if self._detokenizer is not None else ""
        return self.check_stop(new_text)

    def _stop_on_token(self, token_id: int, stop_reason: int | None) -> None:
        """End with "stop" on an eos or stop token ``token_id`` (detokenized only with
        include_stop_str_in_output); the text of the tokens before it that still waits for the
        rest of a character is kept (and a stop string in it still trims the text)."""
        stop_str = None
        if self._detokenizer is not None:
            text = self._detokenizer.add_token(token_id) if self.params.include_stop_str_in_output else ""
            stop_str = self._append_text(text + self._detokenizer.flush())
        self._finish(SequenceStatus.FINISHED_STOPPED, stop_reason if stop_str is None else stop_str)

    def check_stop(self, new_text: str) -> bool:
        """Add ``new_text`` (the text of the latest token) and check text and length stops.

        A stop string found in the tail (overlapping the new text) ends the sequence with
        "stop"; the text is trimmed just before the stop string (or after it, with
        include_stop_str_in_output). Stop strings are searched only once more than ``min_tokens``
        outputs exist, in the text from the first of them on (plus the overlap), as vLLM's
        detokenizer does. Otherwise max_tokens / max_model_len give "length".
        At the length limit the text still waiting for the rest of a character is added first
        (as U+FFFD, the way ``decode`` of the ids shows it).
        """
        if self.num_tokens >= self.max_num_tokens and self._detokenizer is not None:
            new_text += self._detokenizer.flush()
        stop_str = self._append_text(new_text)
        if stop_str is not None:
            self._finish(SequenceStatus.FINISHED_STOPPED, stop_str)
            return True
        if self.num_tokens >= self.max_num_tokens:
            self._finish(SequenceStatus.FINISHED_LENGTH_CAPPED, None)
            return True
        return False

    def _append_text(self, new_text: str) -> str | None:
        """Add ``new_text`` to the output; the stop string found in the tail (overlapping it), the
        text trimmed at it (or after it, with include_stop_str_in_output), or None (always None
        while at most ``min_tokens`` outputs exist)."""
        self.output_text += new_text
        if self.params.min_tokens and len(self.output_token_ids) <= self.params.min_tokens:
            return None
        hit = find_stop_string(
            self.output_text, len(new_text), self.params.stop, self.params.include_stop_str_in_output
        )
        if hit is None:
            return None
        stop_str, keep = hit
        self.output_text = self.output_text[:keep]
        return stop_str

    def abort(self) -> None:
        self._finish(SequenceStatus.FINISHED_ABORTED, None)

    def fail(self) -> None:
        """End with ``finish_reason="error"`` (the engine lost the workers holding its state)."""
        self._finish(SequenceStatus.FINISHED_ERROR, None)

    def reset_to_waiting(self) -> None:
        """Forget every computed token (its KV is gone); it runs again from its first token."""
        self.status = SequenceStatus.WAITING
        self.num_computed_tokens = 0
        self.block_ids = []
        self.num_cached_blocks = 0

    def _finish(self, status: SequenceStatus, stop_reason: str | int | None) -> None:
        self.status = status
        self.finish_reason = status.finish_reason
        self.stop_reason = stop_reason

    def visible_text(self) -> str:
        """Text safe to show: while running, withhold the longest tail that is the start of
        a stop string (it may be trimmed once the rest of the stop string arrives)."""
        text = self.output_text
        if not self.params.stop or self.is_finished or self.params.include_stop_str_in_output:
            return text
        return text[: len(text) - stop_string_holdback(text, self.params.stop)]

    def to_completion_output(self) -> CompletionOutput:
        return CompletionOutput(
            index=self.index,
            text=self.visible_text(),
            token_ids=list(self.output_token_ids),
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
            logprobs=None if self.logprobs is None else list(self.logprobs),  # dicts are never mutated
            logprob_ranks=None if self.logprob_ranks is None else list(self.logprob_ranks),
            cumulative_logprob=self.cumulative_logprob,
        )


@dataclass(eq=False)
class Request:
    """A client request: one prompt, its params, and its ``n`` sequences (same DP rank)."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence]
    metrics: RequestMetrics
    prompt: str | None = None
    dp_rank: int = 0

    @property
    def is_finished(self) -> bool:
        return all(s.is_finished for s in self.seqs)

    def to_output(self) -> RequestOutput:
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,  # never mutated: shared, not copied
            outputs=[s.to_completion_output() for s in self.seqs],
            finished=self.is_finished,
            metrics=self.metrics,
            prompt_logprobs=self.seqs[0].prompt_logprobs and list(self.seqs[0].prompt_logprobs),
            prompt_logprob_ranks=self.seqs[0].prompt_logprob_ranks and list(self.seqs[0].prompt_logprob_ranks),
        )


def _decode_for(decode: DecodeFn, params: SamplingParams) -> DecodeFn:
    """``decode`` as ``params`` want it: with ``skip_special_tokens=False`` the callback is asked to keep
    special tokens (the engine's callback is ``Tokenizer.decode``, which takes that keyword)."""
    if params.skip_special_tokens:
        return decode
    return lambda ids: decode(ids, skip_special_tokens=False)
