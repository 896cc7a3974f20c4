"""What the engine hands to clients: vLLM-shaped, cumulative request outputs.

Each ``RequestOutput`` carries the full text and token ids generated so far (cumulative,
not deltas); a streaming server diffs consecutive outputs. ``logprobs`` is a list with
one dict per generated token mapping token id -> log-probability (the sampled token
first, then the requested top-n), or None when the request did not ask for logprobs.
``RequestOutput.prompt_logprobs`` is the same per prompt token (None for the first), or None.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

FinishReason = Literal["stop", "length", "abort", "error"]

# Upper bounds of the tokens-per-engine-step histogram (vLLM's ``iteration_tokens_total`` buckets).
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


def bucket_index(value: float, bounds: tuple[float, ...]) -> int:
    """The first i with ``value <= bounds[i]``; ``len(bounds)`` (the +Inf bucket) when none."""
    return next((i for i, bound in enumerate(bounds) if value <= bound), len(bounds))


class Logprob(float):
    """A log-probability that also reads as vLLM's ``Logprob``: ``.logprob`` (the value), ``.rank``
    (its rank over the vocabulary, 1 for the most likely; None when unknown) and ``.decoded_token``
    (always None here: decode the id with the tokenizer). It is a float, so arithmetic, comparisons
    and JSON see the number."""

    rank: int | None
    decoded_token: str | None

    def __new__(cls, value: float, rank: int | None = None) -> Logprob:
        obj = super().__new__(cls, value)
        obj.rank, obj.decoded_token = rank, None
        return obj

    def __reduce__(self) -> tuple:
        return (Logprob, (float(self), self.rank))

    @property
    def logprob(self) -> float:
        return float(self)


TokenLogprobs = dict[int, float]


def as_logprobs(entry: TokenLogprobs, token_id: int, rank: int | None) -> TokenLogprobs:
    """One position's ``{token id: logprob}`` with ``Logprob`` values: ``token_id`` (the sampled or
    scored token) gets ``rank``, each other entry (a top-n one) its rank among the entry's values."""
    values = sorted(entry.values(), reverse=True)
    return {t: Logprob(v, rank if t == token_id else 1 + sum(u > v for u in values)) for t, v in entry.items()}


def top_n(entry: TokenLogprobs, n: int) -> list[tuple[int, float]]:
    """The ``n`` most likely ``(token_id, logprob)`` pairs of one position, best first (ties: lower
    id first); n = -1: all of them (``logprobs=-1`` asked for the whole vocabulary)."""
    pairs = sorted(entry.items(), key=lambda kv: (-kv[1], kv[0]))
    return pairs if n < 0 else pairs[:n]


@dataclass
class CompletionOutput:
    """One of the n completions of a request.

    finish_reason: "stop" (EOS, a stop token id or a stop string), "length" (max_tokens
        or max_model_len), "abort", "error" (the engine lost the workers running it: see
        ``launch.recovery``), or None while still generating.
    stop_reason: the stop string or stop token id that ended it (an eos id only generation_config.json adds
        counts as a stop token id, as vLLM adds those to stop_token_ids); None for the tokenizer's EOS and length.
    cumulative_logprob: sum of the sampled tokens' logprobs (None without logprobs).
    logprob_ranks: beside ``logprobs``, each sampled token's rank over the whole vocabulary (vLLM's
        ``Logprob.rank``: how many tokens have a logprob >= its own; 1 for the most likely), or None.
    """

    index: int
    text: str
    token_ids: list[int]
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None
    logprobs: list[TokenLogprobs] | None = None
    cumulative_logprob: float | None = None
    logprob_ranks: list[int | None] | None = None

    def finished(self) -> bool:
        """True once this completion has ended (a method, as vLLM's ``CompletionOutput.finished()``)."""
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """Timestamps on the scheduler's clock (``time.monotonic`` unless injected).

    TTFT = first_token_time - arrival_time; E2E = finished_time - arrival_time.
    """

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0

    @property
    def ttft(self) -> float | None:
        """Seconds from arrival to the first generated token (None before it)."""
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def e2e_latency(self) -> float | None:
        return None if self.finished_time is None else self.finished_time - self.arrival_time


@dataclass
class RequestOutput:
    """The state of one request after a step; ``finished`` once every completion has ended.

    prompt_logprobs: with ``SamplingParams.prompt_logprobs``, one entry per prompt token: None for
        the first, then {prompt token id: log-probability given the tokens before it, then the
        position's top-n} (vLLM's layout); complete from the first output with a token on. Else None.
    prompt_logprob_ranks: beside ``prompt_logprobs``: None for the first prompt token, then each
        prompt token's rank over the whole vocabulary (as ``CompletionOutput.logprob_ranks``), or None.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics = field(default_factory=lambda: RequestMetrics(arrival_time=0.0))
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    prompt_logprob_ranks: list[int | None] | None = None

    @property
    def num_generated_tokens(self) -> int:
        return sum(len(o.token_ids) for o in self.outputs)
