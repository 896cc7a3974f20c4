"""Ray actors as ep4 (DP attention) and tp2 x dp2: greedy tokens equal the single-process run
and transformers, with and without a rebalance forced mid-run; a dead actor is named."""

from __future__ import annotations

import pytest

from launch import LLM, SamplingParams
from tests.oracles import hf_greedy, make_prompts

NEW = 12


def generate(llm: LLM, prompts) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)
    return [list(o.outputs[0].token_ids) for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]


@pytest.fixture(scope="module")
def oracle(hf_checkpoints):
    path = hf_checkpoints["deepseek_v3"]
    prompts = make_prompts(5, 7, 96, shared_prefix=4)
    with LLM(str(path), dtype="float32") as llm:
        single = generate(llm, prompts)
    assert single == hf_greedy(path, prompts, NEW)
    return path, prompts, single


@pytest.mark.parametrize("tp,dp,backend,transport", [(1, 4, "alltoall", "auto"), (2, 2, "alltoall", "socket"),
                                                     (1, 4, "allgather", "ray")])
def test_layout_matches_single_process_and_transformers(ray_local, oracle, tp, dp, backend, transport):
    path, prompts, single = oracle
    with LLM(str(path), dtype="float32", tensor_parallel_size=tp, data_parallel_size=dp,
             enable_expert_parallel=True, all2all_backend=backend, enable_eplb=True, num_redundant_experts=4,
             max_num_batched_tokens=24, block_size=4, step_transport=transport) as llm:
        assert llm.engine.executor.active_transport == ("ray" if transport == "ray" else "socket")
        assert generate(llm, prompts) == single
        infos = llm.engine.executor.infos
        hosted = [sorted(info["local_experts"][1]) for info in infos]
        assert all(len(h) == 3 for h in hosted)  # (8 experts + 4 redundant) / 4 ranks
        if tp == 1:  # every expert hosted somewhere, ranks host different slots
            assert set().union(*map(set, hosted)) == set(range(8))
        llm.engine.request_rebalance()
        assert generate(llm, prompts) == single  # the rebalance ran after the first step of this batch
        assert llm.engine.eplb.counters.num_rebalances == 1
        assert generate(llm, prompts) == single  # and on the new placement throughout


@pytest.mark.parametrize("transport", ["socket", "ray"])
def test_dead_worker_is_named(ray_local, oracle, transport):
    """With recovery off the engine fails fast, naming the rank (tests/ray/test_worker_faults.py
    covers recovery), on either step transport."""
    import time

    import ray

    from launch.recovery import EngineDeadError

    path, prompts, _ = oracle
    llm = LLM(str(path), dtype="float32", data_parallel_size=2, enable_expert_parallel=True,
              recovery_config={"enable_recovery": False}, step_transport=transport)
    try:
        assert llm.engine.executor.active_transport == transport
        ray.kill(llm.engine.executor.group.actors[1], no_restart=True)
        started = time.monotonic()
        with pytest.raises(EngineDeadError, match=r"worker rank 1 on node 0 \(\w+\) died \(killed by the driver\)"):
            generate(llm, prompts)
        assert time.monotonic() - started < 60  # promptly, not after a collective or call timeout
    finally:
        llm.shutdown()


@pytest.mark.parametrize("kwargs", [
    dict(tensor_parallel_size=2, enable_expert_parallel=True),
    dict(tensor_parallel_size=2),  # TP attention, every rank holds every expert
    dict(data_parallel_size=2),  # DP replicas without expert parallelism
    dict(tensor_parallel_size=4),  # more ranks than the 2 kv heads: each kept by two ranks (vLLM's rule)
], ids=["tp2-ep2", "tp2", "dp2", "tp4-kv-replicated"])
def test_gqa_layouts_match_transformers(ray_local, hf_checkpoints, kwargs):
    path = hf_checkpoints["mixtral"]
    prompts = make_prompts(6, 5, 96)
    with LLM(str(path), dtype="float32", **kwargs) as llm:
        assert generate(llm, prompts) == hf_greedy(path, prompts, NEW)


@pytest.mark.slow
@pytest.mark.parametrize("scope,policy,overflow", [("local", "score", "reroute"), ("global", "position", "drop")])
def test_capacity_on_an_ep_group(ray_local, oracle, scope, policy, overflow):
    """Typed capacity settings reach every EP rank: a binding factor drops or reroutes (counted
    over the group), a factor too large to bind gives the single-process tokens."""
    path, prompts, single = oracle
    common = dict(dtype="float32", data_parallel_size=2, enable_expert_parallel=True, capacity_scope=scope,
                  capacity_policy=policy, capacity_overflow=overflow)
    with LLM(str(path), capacity_factor=100.0, **common) as llm:
        assert generate(llm, prompts) == single
        assert llm.engine.counters.tokens_dropped == 0
    with LLM(str(path), capacity_factor=0.5, **common) as llm:
        outs = generate(llm, prompts)
        counters = llm.engine.counters
    assert [len(o) for o in outs] == [NEW] * len(prompts)
    if overflow == "reroute":
        assert counters.tokens_rerouted > 0
    else:
        assert counters.tokens_dropped > 0 and counters.tokens_rerouted == 0


@pytest.mark.slow
def test_global_capacity_under_tp_without_ep_is_the_single_process_capacity(ray_local, oracle):
    """Every TP rank holds the whole batch: capacity is applied to all of it in token order, as
    one process applies it, then the rows are shared out (capping each rank's share changed the
    capacity and the order), and the drops are counted once."""
    path, prompts, _ = oracle
    cap = dict(dtype="float32", capacity_factor=1.0, capacity_scope="global")
    with LLM(str(path), **cap) as llm:
        single, dropped = generate(llm, prompts), llm.engine.counters.tokens_dropped
    assert dropped > 0
    with LLM(str(path), tensor_parallel_size=2, **cap) as llm:
        assert generate(llm, prompts) == single
        assert llm.engine.counters.tokens_dropped == dropped


def test_a_checkpoint_a_rank_cannot_load_is_the_ranks_own_error(ray_local, tiny_ckpt, tmp_path, capsys):
    """A tensor of the wrong shape found by a rank comes back as the loader's own error (its class and
    fields, the message naming the rank), so the command line prints it as one line, as in one process."""
    import json
    import shutil

    from launch.cli import main
    from moe.loading.errors import TensorShapeError

    bad = tmp_path / "bad"
    shutil.copytree(tiny_ckpt, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["moe_intermediate_size"] *= 2
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(TensorShapeError, match=r"^worker rank \d on node 0 \(\w+\) failed in setup: .*shape mismatch") as info:
        LLM(str(bad), dtype="float32", data_parallel_size=2, enable_expert_parallel=True)
    assert info.value.expected != info.value.found  # the fields came across, not just the text
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt_token_ids": [1, 2, 3]}\n')
    rc = main(["generate", "--model", str(bad), "-dp", "2", "--enable-expert-parallel", "--input", str(prompts),
               "--output", str(tmp_path / "o.jsonl")])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "shape mismatch" in err[0] and "Traceback" not in err[0], err
