"""Scheduler: budgets, chunked prefill, preemption, prefix reuse, DP ranks, aborts, stops.

The oracle is a fake model over a simulated paged KV pool: each step writes the batch's
tokens into the slots of the block tables and computes the next token from the context it
gathers back through the block tables. A wrong block table, slot, position or prefix-cache
hit changes the generated tokens, which are compared with a run that had ample room.
"""

from __future__ import annotations

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from launch.core.batch import SampledTokens, SchedulerOutput
from launch.core.block_allocator import BlockAllocator
from launch.core.outputs import RequestOutput
from launch.core.sampling_params import SamplingParams
from launch.core.scheduler import Scheduler, SchedulerConfig

VOCAB = 50
EOS = 0


class PagedFakeModel:
    """Next token = a hash of the full context read back from the paged pool (never EOS)."""

    def __init__(self, dp_size: int, block_size: int) -> None:
        self.pools: list[dict[int, int]] = [{} for _ in range(dp_size)]
        self.block_size = block_size

    def run(self, out: SchedulerOutput) -> list[SampledTokens]:
        results = []
        for batch in out.batches:
            pool, S = self.pools[batch.dp_rank], self.block_size
            for slot, token in zip(batch.slot_mapping, batch.input_ids):
                pool[slot] = token
            tokens = []
            for row in batch.seqs:
                if row.do_sample:
                    ctx = [pool[row.block_ids[p // S] * S + p % S] for p in range(row.context_len)]
                    tokens.append(1 + sum((i + 7) * t for i, t in enumerate(ctx)) % (VOCAB - 1))
            results.append(SampledTokens(token_ids=tokens))
        return results


def make(num_blocks=64, block_size=4, dp_size=1, prefix=True, clock=None, **cfg) -> tuple[Scheduler, PagedFakeModel]:
    config = SchedulerConfig(block_size=block_size, dp_size=dp_size, **cfg)
    allocs = [BlockAllocator(num_blocks, block_size, prefix) for _ in range(dp_size)]
    kwargs = {} if clock is None else {"clock": clock}
    return Scheduler(config, allocs, eos_token_ids=(EOS,), **kwargs), PagedFakeModel(dp_size, block_size)


def run_all(sched: Scheduler, model: PagedFakeModel, max_steps: int = 2000) -> dict[str, RequestOutput]:
    finals = {}
    for _ in range(max_steps):
        if not sched.has_unfinished_requests():
            return finals
        out = sched.schedule()
        for ro in sched.update(out, model.run(out)):
            if ro.finished:
                finals[ro.request_id] = ro
    raise AssertionError("requests did not finish")


def prompt(seed: int, length: int) -> list[int]:
    return [1 + (seed * 13 + i * 7) % (VOCAB - 1) for i in range(length)]


def test_config_validation():
    with pytest.raises(ValueError, match="max_num_seqs"):
        SchedulerConfig(max_num_seqs=0)
    with pytest.raises(ValueError, match="enable_chunked_prefill"):
        SchedulerConfig(max_num_batched_tokens=64, max_model_len=128, enable_chunked_prefill=False)
    with pytest.raises(ValueError, match="one BlockAllocator per DP rank"):
        Scheduler(SchedulerConfig(dp_size=2, block_size=4), [BlockAllocator(8, 4)])
    with pytest.raises(ValueError, match="block_size"):
        Scheduler(SchedulerConfig(block_size=4), [BlockAllocator(8, 8)])


def test_single_request_prefill_then_decode_until_max_tokens():
    sched, model = make()
    sched.add_request("a", prompt(1, 10), SamplingParams(max_tokens=5))
    out = sched.schedule()
    (batch,) = out.batches
    (row,) = batch.seqs
    assert row.token_ids == tuple(prompt(1, 10)) and row.positions == tuple(range(10))
    assert row.do_sample and row.num_computed_tokens == 0 and len(row.block_ids) == 3
    assert batch.query_lens == [10] and batch.context_lens == [10] and batch.logits_indices == [9]
    outs = sched.update(out, model.run(out))
    assert len(outs) == 1 and len(outs[0].outputs[0].token_ids) == 1 and not outs[0].finished
    out = sched.schedule()
    (row,) = out.batches[0].seqs
    assert row.positions == (10,) and row.num_computed_tokens == 10
    sched.update(out, model.run(out))
    finals = run_all(sched, model)
    result = finals["a"].outputs[0]
    assert len(result.token_ids) == 5 and result.finish_reason == "length"
    assert sched.allocators[0].num_free_blocks == 64
    assert sched.num_running == 0 and not sched.has_unfinished_requests()


def test_chunked_prefill_splits_long_prompt_and_decodes_go_first():
    sched, model = make(max_num_batched_tokens=8)
    sched.add_request("short", prompt(2, 3), SamplingParams(max_tokens=10))
    out = sched.schedule()
    sched.update(out, model.run(out))
    sched.add_request("long", prompt(3, 20), SamplingParams(max_tokens=2))
    chunks = []
    for _ in range(3):
        out = sched.schedule()
        (batch,) = out.batches
        assert batch.num_tokens <= 8
        assert batch.seqs[0].request_id == "short" and batch.seqs[0].num_new_tokens == 1  # decode first
        chunks.append(batch.seqs[1])
        sched.update(out, model.run(out))
    assert [c.num_new_tokens for c in chunks] == [7, 7, 6]
    assert [c.num_computed_tokens for c in chunks] == [0, 7, 14]
    assert [c.do_sample for c in chunks] == [False, False, True]
    assert chunks[1].positions == tuple(range(7, 14))
    finals = run_all(sched, model)
    # Same tokens as without chunking.
    ref, ref_model = make(max_num_batched_tokens=64)
    ref.add_request("long", prompt(3, 20), SamplingParams(max_tokens=2))
    assert run_all(ref, ref_model)["long"].outputs[0].token_ids == finals["long"].outputs[0].token_ids


def test_without_chunking_prompt_waits_for_whole_budget():
    sched, model = make(max_num_batched_tokens=16, max_model_len=16, enable_chunked_prefill=False)
    sched.add_request("a", prompt(1, 4), SamplingParams(max_tokens=4))
    out = sched.schedule()
    sched.update(out, model.run(out))
    sched.add_request("b", prompt(2, 16), SamplingParams(max_tokens=1))
    out = sched.schedule()
    assert [r.request_id for r in out.batches[0].seqs] == ["a"]  # 1 + 16 > 16: b waits whole
    assert sched.num_waiting == 1
    sched.update(out, model.run(out))
    finals = run_all(sched, model)
    assert set(finals) == {"a", "b"}


def test_max_num_seqs_caps_running():
    sched, model = make(max_num_seqs=2)
    for i in range(4):
        sched.add_request(f"r{i}", prompt(i, 3), SamplingParams(max_tokens=3))
    out = sched.schedule()
    assert [r.request_id for r in out.batches[0].seqs] == ["r0", "r1"]
    assert sched.num_running == 2 and sched.num_waiting == 2
    sched.update(out, model.run(out))
    assert len(run_all(sched, model)) == 4


def test_preemption_keeps_tokens_and_matches_unconstrained_run():
    params = SamplingParams(max_tokens=12)
    prompts = {f"r{i}": prompt(i, 6) for i in range(4)}
    ref, ref_model = make(num_blocks=64)
    tight, tight_model = make(num_blocks=10)  # 4 seqs x 18 tokens needs 20 blocks: must preempt
    for rid, p in prompts.items():
        ref.add_request(rid, p, params)
        tight.add_request(rid, p, params)
    want = run_all(ref, ref_model)
    got = run_all(tight, tight_model)
    assert tight.num_preemptions > 0 and ref.num_preemptions == 0
    for rid in prompts:
        assert got[rid].outputs[0].token_ids == want[rid].outputs[0].token_ids, rid
    assert sum(o.metrics.num_preemptions for o in got.values()) == tight.num_preemptions
    assert tight.allocators[0].num_free_blocks == 10


def test_preempts_newest_and_resumes_with_generated_tokens():
    sched, model = make(num_blocks=4, block_size=4)
    sched.add_request("old", prompt(1, 4), SamplingParams(max_tokens=8))
    sched.add_request("new", prompt(2, 4), SamplingParams(max_tokens=8))
    preempted_at = None
    for step in range(20):
        out = sched.schedule()
        if out.preempted_seq_ids:
            preempted_at = step
            assert [r.request_id for r in out.batches[0].seqs] == ["old"]
            new_seq = sched.get_request("new").seqs[0]
            assert new_seq.block_ids == [] and new_seq.num_computed_tokens == 0
            generated = list(new_seq.output_token_ids)
            assert generated, "the preempted sequence keeps what it generated"
            sched.update(out, model.run(out))
            break
        sched.update(out, model.run(out))
    assert preempted_at is not None
    finals = run_all(sched, model)
    assert finals["new"].outputs[0].token_ids[: len(generated)] == generated
    assert len(finals["new"].outputs[0].token_ids) == 8


def test_prefix_reuse_across_requests():
    sched, model = make(num_blocks=32, block_size=4)
    shared = prompt(5, 12)
    sched.add_request("first", shared + [3, 4], SamplingParams(max_tokens=2))
    run_all(sched, model)
    sched.add_request("second", shared + [9], SamplingParams(max_tokens=2))
    out = sched.schedule()
    (row,) = out.batches[0].seqs
    assert row.num_computed_tokens == 12 and row.token_ids == (9,)
    sched.update(out, model.run(out))
    finals = run_all(sched, model)
    stats = sched.stats()
    assert stats.prefix_cache_hits == 12 and stats.prefix_cache_queries == 14 + 13
    ref, ref_model = make(prefix=False)
    ref.add_request("second", shared + [9], SamplingParams(max_tokens=2))
    assert run_all(ref, ref_model)["second"].outputs[0].token_ids == finals["second"].outputs[0].token_ids


def test_dp_assignment_and_empty_batches_for_idle_ranks():
    sched, model = make(dp_size=3)
    sched.add_request("big", prompt(1, 30), SamplingParams(max_tokens=4))
    sched.add_request("small", prompt(2, 3), SamplingParams(max_tokens=4))
    sched.add_request("third", prompt(3, 3), SamplingParams(max_tokens=4))
    ranks = {rid: sched.get_request(rid).dp_rank for rid in ("big", "small", "third")}
    assert ranks == {"big": 0, "small": 1, "third": 2}
    sched.add_request("fourth", prompt(4, 3), SamplingParams(max_tokens=4))
    assert sched.get_request("fourth").dp_rank == 1  # ranks 1 and 2 tie at 7 tokens: lower rank
    out = sched.schedule()
    assert len(out.batches) == 3 and [b.dp_rank for b in out.batches] == [0, 1, 2]
    sched.update(out, model.run(out))
    finals = run_all(sched, model)
    assert set(finals) == {"big", "small", "third", "fourth"}
    sched.add_request("solo", prompt(6, 3), SamplingParams(max_tokens=1))
    out = sched.schedule()
    assert [b.is_empty for b in out.batches] == [False, True, True]
    assert out.batches[1].input_ids == [] and out.batches[1].block_tables == []
    sched.update(out, model.run(out))


def test_abort_frees_blocks_for_running_and_waiting():
    sched, model = make(num_blocks=16, max_num_seqs=1)
    sched.add_request("run", prompt(1, 9), SamplingParams(max_tokens=50))
    sched.add_request("wait", prompt(2, 5), SamplingParams(max_tokens=5))
    out = sched.schedule()
    sched.update(out, model.run(out))
    assert sched.allocators[0].num_free_blocks == 13
    final = sched.abort_request("run")
    assert final.finished and final.outputs[0].finish_reason == "abort"
    assert sched.allocators[0].num_free_blocks == 16
    assert sched.abort_request("wait").outputs[0].token_ids == []
    assert sched.abort_request("unknown") is None
    assert not sched.has_unfinished_requests() and sched.num_waiting == 0


def test_abort_during_step_is_ignored_by_update():
    sched, model = make()
    sched.add_request("a", prompt(1, 5))
    out = sched.schedule()
    sched.abort_request("a")
    assert sched.update(out, model.run(out)) == []
    assert sched.allocators[0].num_free_blocks == 64


def test_requests_that_can_never_fit_are_rejected():
    sched, _ = make(num_blocks=4, block_size=4, max_model_len=64)
    with pytest.raises(ValueError, match="exceeds max_model_len"):
        sched.add_request("long", [1] * 65)
    with pytest.raises(ValueError, match="only 4 blocks"):
        sched.add_request("big", [1] * 10, SamplingParams(max_tokens=20))
    with pytest.raises(ValueError, match="empty"):
        sched.add_request("empty", [])
    with pytest.raises(ValueError, match="detokenizer"):
        sched.add_request("stop", [1], SamplingParams(stop="x"))
    sched.add_request("ok", [1] * 10, SamplingParams(max_tokens=7))  # 16 tokens of KV at most
    with pytest.raises(ValueError, match="already in use"):
        sched.add_request("ok", [1])


def test_update_checks_its_input_and_pairing():
    sched, model = make()
    sched.add_request("a", prompt(1, 5))
    out = sched.schedule()
    with pytest.raises(RuntimeError, match="never updated"):
        sched.schedule()
    with pytest.raises(ValueError, match="1 rows sample a token, got 2"):
        sched.update(out, [SampledTokens(token_ids=[1, 2])])
    sched.update(out, model.run(out))
    with pytest.raises(ValueError, match="expected step None"):
        sched.update(out, model.run(out))


def test_eos_stop_token_and_ignore_eos_through_update():
    sched, _ = make()
    sched.add_request("eos", [5, 6], SamplingParams(max_tokens=10))
    sched.add_request("ign", [5, 6], SamplingParams(max_tokens=3, ignore_eos=True))
    sched.add_request("stopid", [5, 6], SamplingParams(max_tokens=10, stop_token_ids=[42]))
    out = sched.schedule()
    outs = {o.request_id: o for o in sched.update(out, [[EOS, EOS, 42]])}  # plain lists work too
    assert outs["eos"].finished and outs["eos"].outputs[0].finish_reason == "stop"
    assert outs["eos"].outputs[0].stop_reason is None and outs["eos"].outputs[0].token_ids == [EOS]
    assert outs["stopid"].outputs[0].stop_reason == 42
    assert not outs["ign"].finished
    assert sched.num_running == 1


def test_stop_strings_with_detokenizer_and_max_model_len():
    config = SchedulerConfig(block_size=4, max_model_len=8)
    sched = Scheduler(config, [BlockAllocator(16, 4)], decode=lambda ids: "".join(chr(96 + t) for t in ids))
    sched.add_request("s", [1, 2], SamplingParams(max_tokens=None, stop=["cd"]))
    sched.add_request("cap", [1, 2], SamplingParams(max_tokens=None))
    streamed, model = [], PagedFakeModel(1, 4)
    for token in (1, 3, 4):  # "a", "c", "d": "acd" contains "cd"
        out = sched.schedule()
        sampled = model.run(out)
        sampled[0].token_ids[0] = token
        outs = {o.request_id: o for o in sched.update(out, sampled)}
        streamed.append(outs["s"].outputs[0].text)
    assert streamed == ["a", "a", "a"]  # "c" held back: it may start "cd"
    final = outs["s"].outputs[0]
    assert final.finish_reason == "stop" and final.stop_reason == "cd" and final.token_ids == [1, 3, 4]
    final = run_all(sched, model)["cap"].outputs[0]
    assert final.finish_reason == "length" and len(final.token_ids) == 6  # 2 + 6 = max_model_len


def test_n_samples_share_request_and_metrics_use_clock():
    ticks = iter(float(i) for i in range(1000))
    sched, model = make(clock=lambda: next(ticks))
    sched.add_request("n", prompt(1, 5), SamplingParams(n=3, max_tokens=2, seed=7))
    seeds = [s.params.seed for s in sched.get_request("n").seqs]
    assert seeds == [7, 8, 9]
    finals = run_all(sched, model)
    ro = finals["n"]
    assert [o.index for o in ro.outputs] == [0, 1, 2] and all(len(o.token_ids) == 2 for o in ro.outputs)
    m = ro.metrics
    assert m.arrival_time < m.first_scheduled_time <= m.first_token_time < m.finished_time
    assert m.ttft == m.first_token_time - m.arrival_time
    stats = sched.stats()
    assert (stats.prompt_tokens_total, stats.generation_tokens_total) == (5, 6)


def test_batch_lists_match_attention_metadata():
    torch = pytest.importorskip("torch")
    from moe.kv_cache import AttentionMetadata

    sched, model = make(max_num_batched_tokens=10)
    sched.add_request("a", prompt(1, 3))
    out = sched.schedule()
    sched.update(out, model.run(out))
    sched.add_request("b", prompt(2, 14))
    batch = sched.schedule().batches[0]
    meta = AttentionMetadata.build(batch.query_lens, batch.context_lens, batch.block_tables, batch.block_size)
    assert meta.slot_mapping.tolist() == batch.slot_mapping
    assert meta.logits_indices().tolist() == [0, 9] and batch.logits_indices == [0]
    assert meta.slot_mapping.shape == (batch.num_tokens,) and meta.slot_mapping.dtype == torch.int64


def test_stats_report_usage_and_queue_lengths():
    sched, model = make(num_blocks=8, max_num_seqs=1)
    sched.add_request("a", prompt(1, 8), SamplingParams(max_tokens=4))
    sched.add_request("b", prompt(2, 4))
    out = sched.schedule()
    stats = sched.stats()
    assert (stats.num_running, stats.num_waiting) == (1, 1)
    assert stats.kv_cache_usage == (pytest.approx(2 / 8),)
    sched.update(out, model.run(out))


@settings(max_examples=30, deadline=None)
@given(
    reqs=st.lists(st.tuples(st.integers(1, 14), st.integers(1, 12), st.integers(0, 3)), min_size=2, max_size=8),
    num_blocks=st.integers(5, 9), budget=st.integers(4, 24), chunked=st.booleans(),
    dp_size=st.integers(1, 2), prefix=st.booleans(), max_num_seqs=st.integers(2, 6),
)
def test_random_workloads_finish_with_reference_tokens(reqs, num_blocks, budget, chunked, dp_size, prefix,
                                                       max_num_seqs):
    budget = budget if chunked else 32
    sched, model = make(num_blocks=num_blocks, dp_size=dp_size, prefix=prefix, max_model_len=32,
                        max_num_batched_tokens=budget, enable_chunked_prefill=chunked, max_num_seqs=max_num_seqs)
    ref, ref_model = make(num_blocks=1000, max_model_len=32)
    pending = sorted(((delay, f"r{i}", prompt(i % 3, plen), mt) for i, (plen, mt, delay) in enumerate(reqs)))
    finals, step = {}, 0
    while pending or sched.has_unfinished_requests():
        while pending and pending[0][0] <= step:
            _, rid, p, mt = pending.pop(0)
            try:
                sched.add_request(rid, p, SamplingParams(max_tokens=mt))
            except ValueError as e:
                assert "blocks" in str(e)
                continue
            ref.add_request(rid, p, SamplingParams(max_tokens=mt))
        out = sched.schedule()
        for batch in out.batches:
            assert batch.num_tokens <= budget and batch.num_seqs <= max_num_seqs
        finals.update({o.request_id: o for o in sched.update(out, model.run(out)) if o.finished})
        step += 1
        assert step < 500, "no progress"
    event(f"preempted: {sched.num_preemptions > 0}")
    want = run_all(ref, ref_model)
    assert set(finals) == set(want)
    for rid, o in finals.items():
        assert o.outputs[0].token_ids == want[rid].outputs[0].token_ids
        assert o.outputs[0].finish_reason == "length"
    assert all(a.num_free_blocks == num_blocks for a in sched.allocators)
