"""The driver's side of penalties, min_tokens and prompt logprobs: the history chunks and releases a
worker's ``TokenHistory`` follows (checked against the sequences' true tokens every step, through
chunked prefill, prefix-cache hits, preemption and two DP ranks), the prompt-logprob spans (each
prompt token scored once, the prefix cache not read), and min_tokens' rules for stop strings and
stop ids on a Sequence (vLLM's)."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from launch.core.batch import SampledTokens, SchedulerOutput
from launch.core.sampling_params import SamplingParams
from launch.core.scheduler import Scheduler
from launch.core.token_history import TokenHistory, prompt_logprob_positions
from tests.unit.test_request import byte_decode, feed, make_seq
from tests.unit.test_scheduler import VOCAB, PagedFakeModel, make, prompt, run_all


class WorkerSide(PagedFakeModel):
    """The fake model plus what a worker does with the new sections: it keeps a ``TokenHistory`` per
    DP rank from the batches alone, checks it against the sequences' true token set and output
    counts on every sampled penalised row, and scores prompt spans as {target: position}."""

    def __init__(self, sched: Scheduler, dp_size: int, block_size: int) -> None:
        super().__init__(dp_size, block_size)
        self.sched = sched
        self.histories = [TokenHistory(VOCAB) for _ in range(dp_size)]
        self.num_checked = 0
        self.num_prefixes = 0

    def run(self, out: SchedulerOutput) -> list[SampledTokens]:
        results = super().run(out)
        for batch, result in zip(out.batches, results):
            history = self.histories[batch.dp_rank]
            history.release(batch.released_seq_ids)
            history.record(batch.history, batch.input_ids, batch.query_lens, batch.context_lens)
            self.num_prefixes += sum(1 for chunk in batch.history if chunk.prefix)
            running = {s.seq_id for s in self.sched._running[batch.dp_rank] if s.params.has_penalties}
            # nothing is missing; nothing leaks (an idle rank's releases wait for its next real batch)
            assert history.seq_ids == running if batch.seqs else history.seq_ids >= running
            for chunk in batch.history:
                row = batch.seqs[chunk.row]
                if row.do_sample:
                    self.check(history, row.seq_id, row.request_id)
            flat, targets = prompt_logprob_positions(batch.prompt_logprobs, batch.input_ids, batch.query_lens,
                                                     batch.context_lens)
            entries, at = [], 0
            for span in batch.prompt_logprobs:
                entries.append([{t: float(q)} for q, t in zip(range(span.start, span.end), targets[at:])])
                at += span.end - span.start
            result.prompt_logprobs = entries if batch.prompt_logprobs else None
        return results

    def check(self, history: TokenHistory, seq_id: int, request_id: str) -> None:
        seq = next(s for s in self.sched.get_request(request_id).seqs if s.seq_id == seq_id)
        seen, counts = history.tables([seq_id])
        assert set(seen[0].nonzero().flatten().tolist()) == set(seq.token_ids)
        assert {t: int(c) for t, c in enumerate(counts[0].tolist()) if c} == Counter(seq.output_token_ids)
        self.num_checked += 1


def scored(prompt_ids: list[int]) -> list:
    """What WorkerSide's scoring gives a whole prompt: None, then position q's entry for token q + 1."""
    return [None] + [{prompt_ids[q + 1]: float(q)} for q in range(len(prompt_ids) - 1)]


@settings(max_examples=25, deadline=None)
@given(num_blocks=st.integers(12, 40), budget=st.sampled_from([5, 8, 64]), dp_size=st.sampled_from([1, 2]),
       seed=st.integers(0, 1000))
def test_worker_history_and_prompt_scores_follow_every_path(num_blocks, budget, dp_size, seed):
    """Requests sharing prefixes, penalised or plain, scoring their prompts or not, n up to 2, in a
    pool that may force preemption: the worker's history matches the truth at every sampled row, no
    history outlives its running sequence, and every scored prompt has one entry per token."""
    sched, _ = make(num_blocks=num_blocks, block_size=4, dp_size=dp_size, max_num_batched_tokens=budget,
                    max_model_len=64)
    model = WorkerSide(sched, dp_size, 4)
    shared = prompt(seed, 9)
    kinds = [dict(repetition_penalty=1.2), dict(prompt_logprobs=1), {}, dict(frequency_penalty=0.5, n=2),
             dict(presence_penalty=-0.5, prompt_logprobs=0, n=2), dict(repetition_penalty=0.9, prompt_logprobs=2)]
    for i in range(8):
        ids = shared[: 4 + (seed + i) % 6] + prompt(seed + i, 1 + (seed * i) % 7)
        sched.add_request(f"r{i}", ids, SamplingParams(max_tokens=3 + i % 4, temperature=0.8, seed=i, **kinds[i % 6]))
    finals = run_all(sched, model, 3000)
    assert model.num_checked > 0
    for i in range(8):
        out = finals[f"r{i}"]
        if kinds[i % 6].get("prompt_logprobs") is None:
            assert out.prompt_logprobs is None
        else:
            assert out.prompt_logprobs == scored(out.prompt_token_ids)


def test_a_penalised_row_on_cached_blocks_carries_the_tokens_the_worker_never_saw():
    sched, _ = make(block_size=4)
    model = WorkerSide(sched, 1, 4)
    ids = prompt(3, 14)
    sched.add_request("plain", ids, SamplingParams(max_tokens=2))
    run_all(sched, model, 3000)
    sched.add_request("pen", ids, SamplingParams(max_tokens=3, repetition_penalty=1.5))
    sched.add_request("other", prompt(4, 5), SamplingParams(max_tokens=6))
    out = sched.schedule()
    (chunk,) = out.batches[0].history
    assert chunk.prefix == tuple(ids[:12]) and out.batches[0].seqs[chunk.row].num_computed_tokens == 12
    sched.update(out, model.run(out))
    out = sched.schedule()
    assert out.batches[0].history[0].prefix == ()  # a decode row: only its own token, already in the batch
    sched.update(out, model.run(out))
    run_all(sched, model, 3000)
    assert model.num_prefixes == 1 and model.num_checked == 3


def test_prompt_scoring_skips_the_prefix_cache_and_n_siblings_reuse_it():
    sched, _ = make(block_size=4)
    model = WorkerSide(sched, 1, 4)
    ids = prompt(5, 13)
    sched.add_request("warm", ids, SamplingParams(max_tokens=1))
    run_all(sched, model, 3000)
    hits = sched.stats().prefix_cache_hits
    sched.add_request("scored", ids, SamplingParams(max_tokens=2, prompt_logprobs=1, n=2))
    out = sched.schedule()
    first, sibling = sorted(out.batches[0].seqs, key=lambda row: row.index)  # the sibling reads the cache
    assert first.num_computed_tokens == 0 and sibling.num_computed_tokens == 12
    assert [(s.row, s.start, s.end) for s in out.batches[0].prompt_logprobs] == [(out.batches[0].seqs.index(first), 0, 12)]
    sched.update(out, model.run(out))
    assert sched.stats().prefix_cache_hits == hits + 12  # the sibling's hit only
    finals = run_all(sched, model, 3000)
    assert finals["scored"].prompt_logprobs == scored(ids)


def test_stop_strings_wait_for_more_than_min_tokens_outputs():
    """vLLM's detokenizer searches stop strings once len(outputs) > min_tokens, in the text the later
    tokens complete (a stop string straddling the boundary counts, one inside the first min_tokens
    tokens never does)."""
    seq = make_seq(SamplingParams(max_tokens=10, stop=["x"], min_tokens=2))
    assert feed(seq, "xx") == ["x", "xx"] and not seq.is_finished
    feed(seq, "ax")
    assert seq.is_finished and seq.output_text == "xxa" and seq.stop_reason == "x"
    straddle = make_seq(SamplingParams(max_tokens=10, stop=["yz"], min_tokens=2))
    feed(straddle, "ayz")
    assert straddle.output_text == "a" and straddle.stop_reason == "yz"
    early = make_seq(SamplingParams(max_tokens=6, stop=["ab"], min_tokens=3))
    feed(early, "abcdef")
    assert early.finish_reason == "length" and early.output_text == "abcdef"


@pytest.mark.parametrize("ignore_eos", [False, True])
def test_stop_ids_and_eos_do_not_end_the_output_before_min_tokens(ignore_eos):
    seq = make_seq(SamplingParams(max_tokens=8, stop_token_ids=[7], min_tokens=3, ignore_eos=ignore_eos), eos=(0,))
    assert not seq.append_token(0) and not seq.append_token(7)
    assert seq.append_token(0) is (not ignore_eos)
    if ignore_eos:
        assert seq.append_token(7) and seq.stop_reason == 7
    assert byte_decode([104]) == "h"
