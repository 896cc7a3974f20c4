"""The typed messages between the scheduler (driver) and the workers.

Shape letters: B sequences in a rank's batch, T tokens in it, S block size.

``SchedulerOutput`` holds one ``BatchSpec`` per DP rank (empty for idle ranks: every EP
rank still enters every MoE collective). A ``BatchSpec`` lists the scheduled sequences
and exposes the flat lists ``moe.kv_cache.AttentionMetadata.build`` takes. Workers send
back one ``SampledTokens`` per rank: a token for each row with ``do_sample``, in order.

Two optional sections serve the rows that need more than their logits' last row:

- ``history`` (rows of requests with a penalty): the worker keeps each such sequence's token
  history (``launch.core.token_history.TokenHistory``) from the tokens it computes, so a decode step
  sends nothing more; only a row whose leading KV came from the prefix cache (tokens the worker
  never saw) carries them once. ``released_seq_ids`` lets the worker drop a history.
- ``prompt_logprobs`` (rows of requests with ``prompt_logprobs`` whose chunk covers prompt
  positions not scored yet): the worker scores those positions' next prompt tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from launch.core.outputs import TokenLogprobs
from launch.core.sampling_params import SamplingParams


@dataclass(slots=True)
class ScheduledSequence:
    """One sequence's work this step (treat as read-only; not frozen because frozen
    dataclasses construct several times slower and the scheduler builds one per row per step).

    token_ids / positions: the tokens to compute (prefill chunk, or the one decode token),
        at positions ``num_computed_tokens ... num_computed_tokens + len(token_ids) - 1``.
    block_ids: the sequence's block table, long enough for all computed tokens after this step.
    do_sample: this chunk reaches the end of the sequence's tokens, so the logits of its last
        token are sampled (false for all but the last chunk of a chunked prefill).
    num_output_tokens: outputs generated so far (the sampler's per-step seed offset).
    """

    request_id: str
    seq_id: int
    index: int
    token_ids: tuple[int, ...]
    positions: tuple[int, ...]
    num_computed_tokens: int
    block_ids: tuple[int, ...]
    do_sample: bool
    params: SamplingParams
    num_output_tokens: int

    @property
    def num_new_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def context_len(self) -> int:
        """Tokens with KV after this step (cached + new)."""
        return self.num_computed_tokens + len(self.token_ids)


@dataclass(frozen=True, slots=True)
class HistoryChunk:
    """A batch row of a sequence with penalties: the worker adds the row's tokens (positions
    ``num_computed_tokens ...``) to the sequence's token history, after ``prefix``.

    row: index into the batch's rows. seq_id: whose history.
    num_prompt_tokens: positions below it hold prompt tokens (the repetition penalty's), the others
        outputs (all three penalties'); a recomputed sequence's outputs stay outputs.
    prefix: the tokens of positions [0, num_computed_tokens) when the worker has not seen them (the
        row's first KV blocks came from the prefix cache this step), else (). A row with no prefix
        starting at position 0 restarts the history; any other row continues it.
    """

    row: int
    seq_id: int
    num_prompt_tokens: int
    prefix: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class PromptLogprobsSpan:
    """Prompt positions [start, end) of a batch row to score: the logits at position q give the
    log-probability of prompt token q + 1 (the row's next input token; for q = end - 1,
    ``next_token_id``, the prompt token at position ``end``), plus the top ``num_logprobs``.
    ``num_computed_tokens <= start < end <= context_len`` of the row and ``end < num_prompt_tokens``."""

    row: int
    start: int
    end: int
    next_token_id: int
    num_logprobs: int


@dataclass(frozen=True)
class BatchSpec:
    """One DP rank's batch for one step (possibly empty).

    history: one ``HistoryChunk`` per row whose request has a penalty (rows in order).
    released_seq_ids: sequences whose token history the worker may drop (finished, aborted or
        preempted since the rank's last batch); only on non-empty batches.
    prompt_logprobs: one ``PromptLogprobsSpan`` per row that scores prompt positions (rows in order).
    """

    dp_rank: int
    block_size: int
    seqs: tuple[ScheduledSequence, ...] = ()
    history: tuple[HistoryChunk, ...] = ()
    released_seq_ids: tuple[int, ...] = ()
    prompt_logprobs: tuple[PromptLogprobsSpan, ...] = ()

    @property
    def is_empty(self) -> bool:
        return not self.seqs

    @property
    def num_seqs(self) -> int:
        return len(self.seqs)

    @property
    def num_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.seqs)

    @property
    def input_ids(self) -> list[int]:
        """[T] token ids of all sequences, concatenated in batch order."""
        return [t for s in self.seqs for t in s.token_ids]

    @property
    def positions(self) -> list[int]:
        """[T] position of each token in its sequence."""
        return [p for s in self.seqs for p in s.positions]

    @property
    def query_lens(self) -> list[int]:
        """[B] tokens computed per sequence this step."""
        return [len(s.token_ids) for s in self.seqs]

    @property
    def context_lens(self) -> list[int]:
        """[B] cached + new tokens per sequence after this step."""
        return [s.context_len for s in self.seqs]

    @property
    def block_tables(self) -> list[list[int]]:
        """[B][blocks] block ids per sequence (ragged; AttentionMetadata pads)."""
        return [list(s.block_ids) for s in self.seqs]

    @property
    def slot_mapping(self) -> list[int]:
        """[T] flat KV slot (block * S + offset) of each computed token."""
        S = self.block_size
        return [s.block_ids[p // S] * S + p % S for s in self.seqs for p in s.positions]

    @property
    def sample_rows(self) -> list[int]:
        """Batch rows whose last token's logits are sampled (``do_sample``)."""
        return [b for b, s in enumerate(self.seqs) if s.do_sample]

    @property
    def logits_indices(self) -> list[int]:
        """[num sampled] index into the flat [T] tokens of each sampled row's last token."""
        out, end = [], 0
        for s in self.seqs:
            end += len(s.token_ids)
            if s.do_sample:
                out.append(end - 1)
        return out

    @property
    def sampling_params(self) -> list[SamplingParams]:
        """Params of the sampled rows, in ``sample_rows`` order."""
        return [s.params for s in self.seqs if s.do_sample]

    @property
    def output_indices(self) -> list[int]:
        """Per sampled row, the index of the output token being sampled (for seeding)."""
        return [s.num_output_tokens for s in self.seqs if s.do_sample]


@dataclass(frozen=True)
class SchedulerOutput:
    """One step: ``batches[r]`` is DP rank r's batch. ``step_id`` pairs it with ``update``."""

    step_id: int
    batches: tuple[BatchSpec, ...]
    preempted_seq_ids: tuple[int, ...] = ()

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(b.num_tokens for b in self.batches)

    @property
    def is_empty(self) -> bool:
        return all(b.is_empty for b in self.batches)


@dataclass
class SampledTokens:
    """A rank's sampling result: ``token_ids[i]`` for the i-th row with ``do_sample``.

    logprobs: None, or per sampled row a dict token id -> logprob (sampled token first,
        then the top-n) or None for rows that did not ask for logprobs.
    prompt_logprobs: None, or per ``PromptLogprobsSpan`` of the batch (in order) one dict per
        position of the span: the scored prompt token first, then the top-n.
    logprob_ranks: beside ``logprobs``: per sampled row the sampled token's rank over the whole
        vocabulary (``launch.core.token_history.token_ranks``), None where ``logprobs`` has None.
    prompt_logprob_ranks: beside ``prompt_logprobs``: per span, per position the scored prompt
        token's rank over the whole vocabulary.
    """

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs | None] | None = None
    prompt_logprobs: list[list[TokenLogprobs]] | None = None
    logprob_ranks: list[int | None] | None = None
    prompt_logprob_ranks: list[list[int]] | None = None
