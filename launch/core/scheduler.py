"""Continuous-batching scheduler over DP ranks, one block allocator per rank.

Each step, per DP rank and under ``max_num_batched_tokens`` / ``max_num_seqs``: running
decodes first, then running prefill chunks, then waiting sequences in arrival order
(FCFS), each taking its uncached prompt whole or, with chunked prefill, as much as the
token budget allows. With prefix caching the n completions of one request compute their
prompt once: the others wait while the first runs its prefill, then reuse its cached blocks
(later requests are admitted meanwhile). When a running sequence cannot get a KV block,
the newest running sequence of that rank is preempted by recomputation: its blocks are
freed and it goes back to the waiting queue with its generated tokens, to be recomputed
later as a longer prompt. A request is assigned to one DP rank when it arrives (least
outstanding tokens, ties to the lower rank); a rank with nothing to do gets an empty
``BatchSpec``.

A sequence still scoring its prompt (``prompt_logprobs``) does not read the prefix cache, as
vLLM: every prompt position's logits must be computed. Rows of requests with penalties carry a
``HistoryChunk`` (``launch.core.batch``); their sequences' ids go back to the worker in
``released_seq_ids`` once they leave the running set.

The engine loop is: ``out = schedule()``, run every rank's batch, ``update(out, sampled)``.
"""

from __future__ import annotations

import dataclasses
import time
from collections import deque
from collections.abc import Callable
from collections.abc import Sequence as SequenceOf
from dataclasses import dataclass, field

from launch.core.batch import (
    BatchSpec,
    HistoryChunk,
    PromptLogprobsSpan,
    SampledTokens,
    ScheduledSequence,
    SchedulerOutput,
)
from launch.core.block_allocator import BlockAllocator
from launch.core.detokenizer import DecodeFn
from launch.core.outputs import RequestMetrics, RequestOutput
from launch.core.request import Request, Sequence, SequenceStatus
from launch.core.sampling_params import SamplingParams


def request_kv_tokens(prompt_len: int, max_tokens: int | None, max_model_len: int) -> int:
    """KV slots a request can fill: its prompt and every token it may generate within
    ``max_model_len`` but the last, which is never fed back."""
    total = max_model_len if max_tokens is None else min(max_model_len, prompt_len + max_tokens)
    return max(prompt_len, total - 1)


@dataclass(frozen=True)
class SchedulerConfig:
    """Limits per DP rank per step (vLLM names). Without chunked prefill a prompt runs in one
    step, so ``max_num_batched_tokens`` must be at least ``max_model_len``."""

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int = 4096
    enable_chunked_prefill: bool = True
    dp_size: int = 1
    block_size: int = 16

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "dp_size", "block_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"SchedulerConfig.{name} must be a positive integer, got {value!r}")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) < max_model_len "
                f"({self.max_model_len}) needs enable_chunked_prefill=True: a long prompt could never run"
            )


@dataclass(frozen=True)
class SchedulerStats:
    num_running: int
    num_waiting: int
    num_preemptions: int
    kv_cache_usage: tuple[float, ...]  # per DP rank, fraction of blocks in use
    prefix_cache_queries: int  # tokens looked up
    prefix_cache_hits: int  # tokens found
    prompt_tokens_total: int  # prompt tokens of requests that produced a first token
    generation_tokens_total: int  # tokens sampled and appended

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0


@dataclass
class _RankStep:
    budget: int
    scheduled: dict[int, tuple[Sequence, int]] = field(default_factory=dict)  # seq_id -> (seq, new)
    preempted: list[int] = field(default_factory=list)
    from_cache: set[int] = field(default_factory=set)  # admitted on cached KV: the worker never saw it


class Scheduler:
    """Decides, each step, which sequences run on which DP rank and how many tokens each."""

    def __init__(
        self,
        config: SchedulerConfig,
        allocators: SequenceOf[BlockAllocator],
        *,
        eos_token_ids: SequenceOf[int] = (),
        decode: DecodeFn | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if len(allocators) != config.dp_size:
            raise ValueError(f"need one BlockAllocator per DP rank: dp_size={config.dp_size}, got {len(allocators)}")
        for r, a in enumerate(allocators):
            if a.block_size != config.block_size:
                raise ValueError(f"allocator {r} has block_size {a.block_size}, config says {config.block_size}")
            if a.num_blocks != allocators[0].num_blocks:
                raise ValueError(f"allocator {r} has {a.num_blocks} blocks, allocator 0 has {allocators[0].num_blocks}")
        self.config = config
        self.allocators = list(allocators)
        self.eos_token_ids = tuple(int(t) for t in eos_token_ids)
        self._decode = decode
        self._clock = clock
        self._requests: dict[str, Request] = {}
        self._seqs: dict[int, Sequence] = {}
        self._waiting: list[deque[Sequence]] = [deque() for _ in range(config.dp_size)]
        self._running: list[list[Sequence]] = [[] for _ in range(config.dp_size)]  # by arrival order
        self._released: list[list[int]] = [[] for _ in range(config.dp_size)]  # for the rank's next batch
        self._next_seq_id = 0
        self._step_id = 0
        self._pending_step: int | None = None
        self.num_preemptions = 0
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0

    # ---- requests ------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: SequenceOf[int],
        params: SamplingParams | None = None,
        *,
        prompt: str | None = None,
        arrival_time: float | None = None,
    ) -> Request:
        """Queue a request on the least-loaded DP rank. Raises ValueError for a request that
        could never be served (duplicate id, empty prompt, too long, needs a detokenizer)."""
        params = params or SamplingParams()
        ids = [int(t) for t in prompt_token_ids]
        self._validate_request(request_id, ids, params)
        rank = self._pick_rank()
        metrics = RequestMetrics(arrival_time=self._clock() if arrival_time is None else arrival_time)
        seqs = []
        for i in range(params.n):
            seq = Sequence(
                seq_id=self._next_seq_id, request_id=request_id, index=i, prompt_token_ids=ids,
                params=params.for_sample(i), max_model_len=self.config.max_model_len,
                arrival_order=self._next_seq_id, eos_token_ids=self.eos_token_ids, dp_rank=rank,
                decode=self._decode,
            )
            self._next_seq_id += 1
            self._seqs[seq.seq_id] = seq
            self._waiting[rank].append(seq)
            seqs.append(seq)
        request = Request(request_id, ids, params, seqs, metrics, prompt=prompt, dp_rank=rank)
        self._requests[request_id] = request
        return request

    def _validate_request(self, request_id: str, ids: list[int], params: SamplingParams) -> None:
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        try:
            self.check_request(ids, params)
        except ValueError as e:
            named = ValueError(f"request {request_id!r}: {e}")
            if hasattr(e, "param"):
                named.param = e.param
            raise named from None

    def check_request(self, ids: SequenceOf[int], params: SamplingParams) -> None:
        """ValueError naming why a request of these prompt ids and params could never be served
        here (empty prompt, negative ids, longer than max_model_len, stop strings without a
        detokenizer, more KV than a rank's pool); what ``add_request`` checks, without queueing."""
        if not ids:
            raise ValueError("the prompt is empty")
        if min(ids) < 0:
            raise ValueError(f"negative token id {min(ids)} in the prompt")
        max_len = self.config.max_model_len
        if len(ids) > max_len:
            raise ValueError(f"prompt of {len(ids)} tokens exceeds max_model_len={max_len}")
        if params.stop and self._decode is None:
            raise ValueError("stop strings need a detokenizer (Scheduler(decode=...))")
        kv_tokens = request_kv_tokens(len(ids), params.max_tokens, max_len)
        alloc = self.allocators[0]
        if alloc.blocks_needed(kv_tokens) > alloc.num_blocks:
            error = ValueError(f"needs KV for {kv_tokens} tokens ({alloc.blocks_needed(kv_tokens)} blocks "
                               f"of {alloc.block_size}) but a DP rank's pool has only {alloc.num_blocks} blocks")
            # the field to change: the prompt when it alone is too long, else max_tokens (the server's param)
            error.param = "prompt" if alloc.blocks_needed(len(ids)) > alloc.num_blocks else "max_tokens"
            raise error

    def _pick_rank(self) -> int:
        load = [0] * self.config.dp_size
        for seq in self._seqs.values():
            load[seq.dp_rank] += seq.num_outstanding_tokens
        return min(range(self.config.dp_size), key=lambda r: (load[r], r))

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a request now and free its blocks; returns its final output (None if unknown)."""
        request = self._requests.pop(request_id, None)
        if request is None:
            return None
        for seq in request.seqs:
            if not seq.is_finished:
                self._retire(seq)
                seq.abort()
            self._seqs.pop(seq.seq_id, None)
        request.metrics.finished_time = self._clock()
        return request.to_output()

    def reset_after_fault(
        self, allocators: SequenceOf[BlockAllocator], may_retry: Callable[[Request], bool]
    ) -> tuple[list[str], list[RequestOutput]]:
        """The workers lost every KV block: adopt ``allocators`` (fresh; the prefix cache is
        gone too; one per DP rank of the group that runs next, which may have fewer or more
        ranks than before), requeue each request with ``may_retry(request)`` to be recomputed
        from its first token, end every other one with ``finish_reason="error"``. A step
        scheduled but never updated is dropped. Returns (requeued ids, outputs of the failed)."""
        if not allocators or any(a.block_size != self.config.block_size for a in allocators):
            raise ValueError(f"need at least one allocator of block_size {self.config.block_size}")
        old_dp = self.config.dp_size
        self.config = dataclasses.replace(self.config, dp_size=len(allocators))
        self.allocators = list(allocators)
        self._pending_step = None
        retried, failed = [], []
        now = self._clock()
        for request_id, request in list(self._requests.items()):
            if may_retry(request):
                retried.append(request_id)
                continue
            for seq in request.seqs:
                if not seq.is_finished:
                    seq.fail()
                self._seqs.pop(seq.seq_id, None)
            del self._requests[request_id]
            request.metrics.finished_time = now
            failed.append(request.to_output())
        alive = [s for rank in range(old_dp) for s in (*self._running[rank], *self._waiting[rank])
                 if s.seq_id in self._seqs]
        self._running = [[] for _ in range(self.config.dp_size)]
        self._waiting = [deque() for _ in range(self.config.dp_size)]
        self._released = [[] for _ in range(self.config.dp_size)]  # the new workers hold no history
        for request in self._requests.values():  # a request's seqs stay together on one rank
            request.dp_rank %= self.config.dp_size
            for seq in request.seqs:
                seq.dp_rank = request.dp_rank
        for seq in sorted(alive, key=lambda s: s.arrival_order):
            seq.reset_to_waiting()
            self._waiting[seq.dp_rank].append(seq)
        return retried, failed

    def _retire(self, seq: Sequence) -> None:
        """Take a sequence out of the queues and release its blocks."""
        rank = seq.dp_rank
        if seq in self._running[rank]:
            self._running[rank].remove(seq)
            self._release_history(rank, seq)
        elif seq in self._waiting[rank]:
            self._waiting[rank].remove(seq)
        self.allocators[rank].free(seq)

    def _release_history(self, rank: int, seq: Sequence) -> None:
        if seq.keeps_history:
            self._released[rank].append(seq.seq_id)

    # ---- scheduling ----------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Build one step's batches (one per DP rank). Must be followed by ``update``."""
        if self._pending_step is not None:
            raise RuntimeError(f"step {self._pending_step} was scheduled but never updated; call update() first")
        batches, preempted = [], []
        for rank in range(self.config.dp_size):
            ctx = _RankStep(budget=self.config.max_num_batched_tokens)
            self._schedule_running(rank, ctx)
            if not ctx.preempted:  # a rank short of blocks admits nothing new this step
                self._schedule_waiting(rank, ctx)
            batches.append(self._build_batch(rank, ctx))
            preempted.extend(ctx.preempted)
        self._step_id += 1
        self._pending_step = self._step_id
        return SchedulerOutput(step_id=self._step_id, batches=tuple(batches), preempted_seq_ids=tuple(preempted))

    def _schedule_running(self, rank: int, ctx: _RankStep) -> None:
        running = self._running[rank]
        decodes = [s for s in running if s.num_tokens - s.num_computed_tokens == 1]
        prefills = [s for s in running if s.num_tokens - s.num_computed_tokens > 1]
        for seq in decodes + prefills:
            if ctx.budget <= 0:
                break
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted earlier in this step
            num_new = min(seq.num_tokens - seq.num_computed_tokens, ctx.budget)
            if self._make_room(rank, seq, num_new, ctx):
                self.allocators[rank].append_slots(seq, num_new)
                ctx.scheduled[seq.seq_id] = (seq, num_new)
                ctx.budget -= num_new

    def _make_room(self, rank: int, seq: Sequence, num_new: int, ctx: _RankStep) -> bool:
        """Preempt the newest running sequences until ``seq`` can grow; False if ``seq`` itself went."""
        alloc = self.allocators[rank]
        while not alloc.can_append(seq, num_new):
            victim = self._running[rank][-1]
            self._preempt(rank, victim, ctx)
            if victim is seq:
                return False
        return True

    def _preempt(self, rank: int, seq: Sequence, ctx: _RankStep) -> None:
        self._running[rank].remove(seq)
        self._release_history(rank, seq)
        if seq.seq_id in ctx.scheduled:
            ctx.budget += ctx.scheduled.pop(seq.seq_id)[1]
        self.allocators[rank].free(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.PREEMPTED
        self._insert_waiting(rank, seq)
        ctx.preempted.append(seq.seq_id)
        self.num_preemptions += 1
        self._requests[seq.request_id].metrics.num_preemptions += 1

    def _insert_waiting(self, rank: int, seq: Sequence) -> None:
        """Put a preempted sequence back in arrival order (it lands at or near the front)."""
        waiting = self._waiting[rank]
        pos = 0
        while pos < len(waiting) and waiting[pos].arrival_order < seq.arrival_order:
            pos += 1
        waiting.insert(pos, seq)

    def _schedule_waiting(self, rank: int, ctx: _RankStep) -> None:
        alloc, waiting, running = self.allocators[rank], self._waiting[rank], self._running[rank]
        head = 0  # waiting[:head] wait for a sibling's prefill (``_awaits_sibling_prefix``)
        while head < len(waiting) and ctx.budget > 0 and len(running) < self.config.max_num_seqs:
            seq = waiting[head]
            num_cached = alloc.num_cached_tokens(seq)
            if not seq.needs_prompt_logprobs and self._awaits_sibling_prefix(seq, num_cached, alloc):
                head += 1  # it starts once a sibling has cached the prompt; the queue behind it goes on
                continue
            num_new = seq.num_tokens - num_cached
            if num_new > ctx.budget:
                if not self.config.enable_chunked_prefill:
                    break  # FCFS: the head waits for a step with room for its whole prompt
                num_new = ctx.budget
            if not alloc.can_allocate(seq, num_new):
                break
            alloc.allocate(seq, num_new)
            if seq.num_computed_tokens and seq.keeps_history:
                ctx.from_cache.add(seq.seq_id)
            del waiting[head]
            seq.status = SequenceStatus.RUNNING
            pos = len(running)
            while pos > 0 and running[pos - 1].arrival_order > seq.arrival_order:
                pos -= 1
            running.insert(pos, seq)
            ctx.scheduled[seq.seq_id] = (seq, num_new)
            ctx.budget -= num_new
            metrics = self._requests[seq.request_id].metrics
            if metrics.first_scheduled_time is None:
                metrics.first_scheduled_time = self._clock()

    def _awaits_sibling_prefix(self, seq: Sequence, num_cached: int, alloc: BlockAllocator) -> bool:
        """With prefix caching, a fresh completion of an n > 1 request waits while a sibling runs
        the shared prompt's prefill and would cache more of its full blocks than ``num_cached``
        tokens: it then reuses those blocks instead of computing the prompt again (vLLM computes
        the prompt once for all n). Blocks are cached once computed (after ``update``), so it
        starts a step (or a chunked prefill) later."""
        if not alloc.enable_prefix_caching or seq.num_output_tokens:
            return False
        if (seq.num_prompt_tokens - 1) // alloc.block_size * alloc.block_size <= num_cached:
            return False  # nothing more of the prompt can come from the cache
        return any(s is not seq and s.status is SequenceStatus.RUNNING and s.num_computed_tokens < s.num_prompt_tokens
                   for s in self._requests[seq.request_id].seqs)

    def _build_batch(self, rank: int, ctx: _RankStep) -> BatchSpec:
        rows, history, spans = [], [], []
        for seq, num_new in ctx.scheduled.values():
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + num_new
            params = seq.params
            if seq.keeps_history:
                prefix = tuple(seq.token_slice(0, start)) if seq.seq_id in ctx.from_cache else ()
                history.append(HistoryChunk(len(rows), seq.seq_id, seq.num_prompt_tokens, prefix))
            if seq.prompt_logprobs is not None:
                span = seq.prompt_logprobs_span(start, end)
                if span is not None:
                    spans.append(PromptLogprobsSpan(len(rows), *span, num_logprobs=params.prompt_logprobs))
            rows.append(ScheduledSequence(
                request_id=seq.request_id, seq_id=seq.seq_id, index=seq.index,
                token_ids=tuple(seq.token_slice(start, end)), positions=tuple(range(start, end)),
                num_computed_tokens=start, block_ids=tuple(seq.block_ids), do_sample=end == seq.num_tokens,
                params=params, num_output_tokens=seq.num_output_tokens,
            ))
        released = ()
        if rows and self._released[rank]:  # an empty batch may never run: keep them for a real one
            released, self._released[rank] = tuple(self._released[rank]), []
        return BatchSpec(dp_rank=rank, block_size=self.config.block_size, seqs=tuple(rows), history=tuple(history),
                         released_seq_ids=released, prompt_logprobs=tuple(spans))

    # ---- results -------------------------------------------------------------------

    def update(
        self, output: SchedulerOutput, sampled: SequenceOf[SampledTokens | SequenceOf[int]]
    ) -> list[RequestOutput]:
        """Apply one step's results: advance computed tokens, append sampled tokens, check
        stops, free finished sequences. ``sampled[r]`` (a SampledTokens or a plain list of
        token ids) has one token per ``do_sample`` row of rank r's batch, in batch order.
        Returns a cumulative output for every request that got a token."""
        if output.step_id != self._pending_step:
            raise ValueError(f"update() got step {output.step_id}, expected step {self._pending_step}")
        if len(sampled) != len(output.batches):
            raise ValueError(f"need one SampledTokens per DP rank ({len(output.batches)}), got {len(sampled)}")
        sampled = [r if isinstance(r, SampledTokens) else SampledTokens(token_ids=list(r)) for r in sampled]
        for batch, result in zip(output.batches, sampled):
            want = len(batch.sample_rows)
            if len(result.token_ids) != want:
                raise ValueError(f"rank {batch.dp_rank}: {want} rows sample a token, got {len(result.token_ids)} tokens")
            if result.logprobs is not None and len(result.logprobs) != want:
                raise ValueError(f"rank {batch.dp_rank}: {want} sampled rows, got {len(result.logprobs)} logprobs")
            spans, got = batch.prompt_logprobs, result.prompt_logprobs
            if spans and (got is None or [len(e) for e in got] != [s.end - s.start for s in spans]):
                raise ValueError(f"rank {batch.dp_rank}: prompt logprobs do not match the batch's {len(spans)} prompt spans")
        self._pending_step = None
        now = self._clock()
        touched: dict[str, Request] = {}
        for batch, result in zip(output.batches, sampled):
            self._apply_batch(batch, result, now, touched)
        outputs = []
        for request in touched.values():
            if request.is_finished:
                request.metrics.finished_time = now
                self._requests.pop(request.request_id, None)
                for seq in request.seqs:
                    self._seqs.pop(seq.seq_id, None)
            outputs.append(request.to_output())
        return outputs

    def _apply_batch(self, batch: BatchSpec, result: SampledTokens, now: float, touched: dict[str, Request]) -> None:
        alloc = self.allocators[batch.dp_rank]
        prompt_ranks = result.prompt_logprob_ranks or [None] * len(batch.prompt_logprobs)
        for span, entries, ranks in zip(batch.prompt_logprobs, result.prompt_logprobs or (), prompt_ranks):
            seq = self._seqs.get(batch.seqs[span.row].seq_id)
            if seq is not None and seq.status is SequenceStatus.RUNNING:
                seq.add_prompt_logprobs(span.start, entries, ranks)
        k = 0
        for row in batch.seqs:
            token, logprobs, rank = None, None, None
            if row.do_sample:
                token = result.token_ids[k]
                logprobs = result.logprobs[k] if result.logprobs is not None else None
                rank = result.logprob_ranks[k] if result.logprob_ranks is not None else None
                k += 1
            seq = self._seqs.get(row.seq_id)
            if seq is None or seq.status is not SequenceStatus.RUNNING:
                continue  # aborted while the step ran
            seq.num_computed_tokens = row.context_len
            alloc.cache_computed_blocks(seq)
            if token is None:
                continue
            if isinstance(token, bool) or int(token) < 0:
                raise ValueError(f"sequence {seq.seq_id}: invalid sampled token id {token!r}")
            request = self._requests[seq.request_id]
            if seq.append_token(int(token), logprobs, rank):
                self._retire(seq)
            self.generation_tokens_total += 1
            metrics = request.metrics
            if metrics.first_token_time is None:
                metrics.first_token_time = now
                self.prompt_tokens_total += len(request.prompt_token_ids)
            metrics.last_token_time = now
            touched[request.request_id] = request

    # ---- introspection -------------------------------------------------------------

    @property
    def num_running(self) -> int:
        return sum(len(r) for r in self._running)

    @property
    def num_waiting(self) -> int:
        return sum(len(w) for w in self._waiting)

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    def get_request(self, request_id: str) -> Request | None:
        return self._requests.get(request_id)

    def stats(self) -> SchedulerStats:
        cache = [a.prefix_cache_stats() for a in self.allocators]
        return SchedulerStats(
            num_running=self.num_running,
            num_waiting=self.num_waiting,
            num_preemptions=self.num_preemptions,
            kv_cache_usage=tuple(a.usage for a in self.allocators),
            prefix_cache_queries=sum(c.queries for c in cache),
            prefix_cache_hits=sum(c.hits for c in cache),
            prompt_tokens_total=self.prompt_tokens_total,
            generation_tokens_total=self.generation_tokens_total,
        )
