"""QA of the scheduler against vLLM: the n completions of one request compute their prompt once
(prefix caching), with the same tokens as completions that each computed it.

The fake model reads every context back through the block tables (``tests.unit.test_scheduler``),
so a wrongly shared block would change the tokens.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from launch.core.sampling_params import SamplingParams
from tests.unit.test_scheduler import make, prompt, run_all

PROMPT_LEN = 9


def run_counting(sched, model) -> tuple[dict, int, int]:
    """Run to the end; returns (final outputs, prompt positions computed, largest block ref count)."""
    finals, prefill_tokens, max_refs = {}, 0, 0
    while sched.has_unfinished_requests():
        out = sched.schedule()
        for batch in out.batches:
            prefill_tokens += sum(p < PROMPT_LEN for s in batch.seqs for p in s.positions)
            alloc = sched.allocators[batch.dp_rank]
            max_refs = max([max_refs] + [alloc.ref_count(b) for s in batch.seqs for b in s.block_ids])
        for ro in sched.update(out, model.run(out)):
            if ro.finished:
                finals[ro.request_id] = ro
    return finals, prefill_tokens, max_refs


@pytest.mark.parametrize("budget", [64, 4])  # whole prompts, and chunked prefill of 4 tokens a step
def test_n_completions_compute_a_shared_prompt_once(budget):
    """A 9-token prompt, blocks of 4, n=3: vLLM computes the prompt once and the other two
    completions reuse its 2 full blocks (each computes only its last token); before, every
    completion computed all 9 prompt tokens in the same step and held its own copy."""
    params = SamplingParams(n=3, max_tokens=5, ignore_eos=True)
    sched, model = make(block_size=4, max_num_batched_tokens=budget)
    sched.add_request("n", prompt(3, PROMPT_LEN), params)
    shared, prefill_tokens, max_refs = run_counting(sched, model)
    assert prefill_tokens == PROMPT_LEN + 1 + 1
    assert max_refs == 3  # the prompt's full blocks are held by all three completions
    assert sched.stats().kv_cache_usage == (0.0,)

    sched, model = make(block_size=4, max_num_batched_tokens=budget, prefix=False)
    sched.add_request("n", prompt(3, PROMPT_LEN), params)
    alone, prefill_tokens, _ = run_counting(sched, model)
    assert prefill_tokens == 3 * PROMPT_LEN  # no cache, nothing to share
    assert [o.token_ids for o in shared["n"].outputs] == [o.token_ids for o in alone["n"].outputs]


def test_waiting_completions_do_not_hold_back_later_requests():
    """While an n > 1 request's first completion runs its prefill, the others wait for its blocks;
    a later request behind them is admitted meanwhile (the queue is not stalled)."""
    sched, model = make(block_size=4)
    sched.add_request("n", prompt(1, 9), SamplingParams(n=2, max_tokens=3, ignore_eos=True))
    sched.add_request("later", prompt(2, 5), SamplingParams(max_tokens=3, ignore_eos=True))
    first = sched.schedule()
    assert [s.request_id for s in first.batches[0].seqs] == ["n", "later"]
    sched.update(first, model.run(first))
    second = sched.schedule()
    rows = {(s.request_id, s.index): len(s.token_ids) for s in second.batches[0].seqs}
    assert rows[("n", 1)] == 1  # 8 of its 9 prompt tokens come from its sibling's blocks
    sched.update(second, model.run(second))
    finals = run_all(sched, model)
    assert set(finals) == {"n", "later"}


def test_short_prompt_completions_start_together():
    """A prompt without a full block to share: nothing to wait for, all n start in one step."""
    sched, _ = make(block_size=4)
    sched.add_request("n", prompt(1, 4), SamplingParams(n=3, max_tokens=2))
    assert len(sched.schedule().batches[0].seqs) == 3


@settings(max_examples=30, deadline=None)
@given(
    reqs=st.lists(st.tuples(st.integers(1, 14), st.integers(1, 8), st.integers(1, 3), st.integers(0, 3)),
                  min_size=1, max_size=6),
    num_blocks=st.integers(6, 12), budget=st.integers(4, 24), chunked=st.booleans(), prefix=st.booleans(),
    max_num_seqs=st.integers(1, 6),
)
def test_random_n_workloads_finish_with_reference_tokens(reqs, num_blocks, budget, chunked, prefix, max_num_seqs):
    """Requests with n = 1..3 arriving over time, tight pools (preemption), chunked or whole
    prefills: every completion finishes (a waiting sibling never stalls the queue for good) with
    the tokens of an unconstrained run, and every block is returned."""
    budget = budget if chunked else 32
    sched, model = make(num_blocks=num_blocks, prefix=prefix, max_model_len=32, max_num_batched_tokens=budget,
                        enable_chunked_prefill=chunked, max_num_seqs=max_num_seqs)
    ref, ref_model = make(num_blocks=1000, max_model_len=32)
    pending = sorted((delay, f"r{i}", prompt(i % 3, plen), mt, n) for i, (plen, mt, n, delay) in enumerate(reqs))
    finals, step = {}, 0
    while pending or sched.has_unfinished_requests():
        while pending and pending[0][0] <= step:
            _, rid, p, mt, n = pending.pop(0)
            try:
                sched.add_request(rid, p, SamplingParams(n=n, max_tokens=mt))
            except ValueError as e:
                assert "blocks" in str(e)
                continue
            ref.add_request(rid, p, SamplingParams(n=n, max_tokens=mt))
        out = sched.schedule()
        finals.update({o.request_id: o for o in sched.update(out, model.run(out)) if o.finished})
        step += 1
        assert step < 1000, "no progress"
    want = run_all(ref, ref_model)
    assert set(finals) == set(want)
    for rid, o in finals.items():
        assert [c.token_ids for c in o.outputs] == [c.token_ids for c in want[rid].outputs]
    assert all(a.num_free_blocks == num_blocks for a in sched.allocators)
