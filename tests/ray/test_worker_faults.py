"""Tests that break things: a worker rank SIGKILLed mid-generation under the OpenAI server,
killed during a live expert migration, and stalled (SIGSTOP) inside a collective.

Each checks that no request hangs, that every request ends with its full correct answer
(retried) or an error it can see (none lost), that the engine serves again on its own, and
that greedy tokens afterwards equal the single-process run. Figures (time to detect, time
to recover, retried/failed/lost) are printed per fault (``pytest -s``) for docs/reliability.md.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch

from launch import LLM, SamplingParams
from tests.oracles import make_prompts
from tests.ray.test_eplb_live import biased_checkpoint

NEW = 16


def kill(pid: int, sig: int = signal.SIGKILL) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def report(fault: str, counters, kill_time: float, retried: int, failed: int, lost: int) -> dict:
    figures = {"fault": fault, "detect_s": round(counters.last_fault_time - kill_time, 3),
               "recover_s": round(counters.last_recovery_seconds, 2), "retried": retried, "failed": failed,
               "lost": lost}
    print("\nFAULT FIGURES " + json.dumps(figures))
    return figures


def greedy(llm: LLM, prompts: list[list[int]], n: int = NEW) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    return [list(o.outputs[0].token_ids) for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]


# ---- the server: SIGKILL a rank while 8 requests generate ------------------------------------


def stream_completion(url: str, body: dict) -> dict:
    """One streamed completion: its text, whether an error event came, and whether [DONE] did."""
    text, error, done, status = "", None, False, None
    with httpx.stream("POST", url, json=dict(body, stream=True), timeout=120) as r:
        status = r.status_code
        if status != 200:
            r.read()
            return {"status": status, "error": r.json()["error"], "text": "", "done": False}
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            data = line[len("data: "):]
            if data == "[DONE]":
                done = True
                continue
            event = json.loads(data)
            if "error" in event:
                error = event["error"]
            else:
                text += event["choices"][0]["text"]
    return {"status": status, "error": error, "text": text, "done": done}


def plain_completion(url: str, body: dict) -> dict:
    r = httpx.post(url, json=body, timeout=120)
    if r.status_code != 200:
        return {"status": r.status_code, "error": r.json()["error"], "text": ""}
    return {"status": 200, "error": None, "text": r.json()["choices"][0]["text"]}


def test_server_survives_a_worker_killed_mid_generation(ray_local, tiny_ckpt_with_tokenizer, tmp_path):
    from launch.config import RuntimeConfig
    from tests.server.test_server_live import LiveServer

    tiny = tiny_ckpt_with_tokenizer
    prompts = make_prompts(11, 8, 200)
    with LLM(str(tiny), dtype="float32") as llm:
        params = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)
        expected = [o.outputs[0].text for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]
    cfg = RuntimeConfig.from_dict({
        "model": str(tiny),
        "parallel": {"data_parallel_size": 2, "enable_expert_parallel": True, "collective_timeout_s": 20},
        "engine": {"dtype": "float32", "max_model_len": 96, "num_kv_blocks": 64, "block_size": 8,
                   "max_num_seqs": 2},  # per DP rank: 4 run, 4 wait
        "recovery": {"backoff_s": 0.2},
        "server": {"expert_distribution_dir": str(tmp_path)},
    })
    with LiveServer(cfg) as srv:
        url = srv.base_url + "/v1/completions"
        bodies = [{"prompt": p, "max_tokens": NEW, "temperature": 0, "ignore_eos": True} for p in prompts]
        # Hold the engine thread until all eight requests are queued for it, so that they are
        # admitted together (on a loaded box the HTTP threads can trail the first steps).
        gate = threading.Event()
        holder = threading.Thread(target=srv.engine.call, args=(lambda _engine: gate.wait(60),), daemon=True)
        holder.start()
        with ThreadPoolExecutor(len(bodies)) as pool:
            futures = [pool.submit(stream_completion if i % 2 else plain_completion, url, b)
                       for i, b in enumerate(bodies)]
            deadline = time.monotonic() + 60
            while srv.engine._inbox.qsize() < len(bodies) and time.monotonic() < deadline:
                time.sleep(0.01)
            gate.set()
            holder.join(timeout=60)
            while srv.engine.stats().generation_tokens_total < 6 and time.monotonic() < deadline:
                time.sleep(0.01)  # mid-generation: the first four have tokens, the rest wait
            before = srv.engine.stats()
            assert before.num_running + before.num_waiting == len(bodies) and before.num_waiting >= 1, before
            pid = srv.engine.engine.executor.infos[1]["pid"]
            killed_at = time.monotonic()
            kill(pid)
            results = [f.result(timeout=150) for f in futures]  # none hangs
        healthy_at = None
        while time.monotonic() - killed_at < 60:
            if httpx.get(srv.base_url + "/health", timeout=10).status_code == 200:
                healthy_at = time.monotonic()
                break
            time.sleep(0.1)
        assert healthy_at is not None, "not serving again within 60 s of the kill"
        ok = [i for i, r in enumerate(results) if r["error"] is None]
        failed = [i for i, r in enumerate(results) if r["error"] is not None]
        for i in ok:
            assert results[i]["text"] == expected[i], i
            assert results[i].get("done", True)
        for i in failed:
            err = results[i]["error"]
            assert err["code"] == 503 and "worker rank 1" in err["message"], err
            assert "actor_id" not in err["message"] and "namespace" not in err["message"]
            assert results[i].get("done", True)  # a stream still ends with [DONE]
        stats = srv.engine.stats()
        assert len(ok) + len(failed) == len(prompts)
        assert stats.num_requests_retried >= 1 and stats.num_requests_failed == len(failed) >= 1
        assert stats.num_worker_faults == 1 and stats.num_recoveries == 1 and stats.engine_state == 0
        # serving again (degraded on rank 0, then the full layout once the replacement is up,
        # taken in between requests or while idle), token-exact, and the gauges back to idle
        again = [plain_completion(url, b) for b in bodies[:2]]
        assert [a["text"] for a in again] == expected[:2]
        deadline = time.monotonic() + 90
        while srv.engine.stats().num_missing_ranks and time.monotonic() < deadline:
            time.sleep(0.2)
        assert srv.engine.stats().num_missing_ranks == 0, "the replacement never joined"
        assert srv.engine.engine.executor.group.num_ranks == 2
        again = [plain_completion(url, b) for b in bodies[2:4]]
        assert [a["text"] for a in again] == expected[2:4]
        metrics = httpx.get(srv.base_url + "/metrics", timeout=10).text
        label = f'{{model_name="{cfg.served_model_name}"}}'
        assert f"vllm:num_requests_running{label} 0.0" in metrics
        assert f"vllm:num_requests_waiting{label} 0.0" in metrics
        assert f"moe:requests_failed_total{label} {float(len(failed))}" in metrics
        assert f"moe:worker_ranks_missing{label} 0.0" in metrics and f"moe:engine_state{label} 0.0" in metrics
        report("SIGKILL rank 1 of EP2 mid-generation (server, 8 requests)",
               srv.engine.engine.supervisor.counters, killed_at, stats.num_requests_retried, len(failed),
               len(prompts) - len(ok) - len(failed))


# ---- offline: a kill during a live expert migration, and a rank stalled in a collective -----


@pytest.fixture(scope="module")
def ep2(ray_local, hf_checkpoints, tmp_path_factory):
    """(LLM on EP2 with EPLB + 2 redundant slots, prompts, single-process tokens, fingerprint
    of each logical expert [L][E] from the identity placement)."""
    path = biased_checkpoint(hf_checkpoints["deepseek_v3"], tmp_path_factory.mktemp("biased") / "ckpt")
    prompts = make_prompts(21, 6, 96)
    with LLM(str(path), dtype="float32") as llm:
        single = greedy(llm, prompts)
    llm = LLM(str(path), dtype="float32", data_parallel_size=2, enable_expert_parallel=True, enable_eplb=True,
              num_redundant_experts=2, eplb_config={"window_size": 1000, "step_interval": 100000},
              collective_timeout_s=3.0, recovery_config={"backoff_s": 0.2, "degraded_mode": False})
    try:
        assert greedy(llm, prompts) == single
        reference = expert_prints(llm)
        yield llm, prompts, single, reference
    finally:
        llm.shutdown()


def expert_prints(llm: LLM) -> dict[tuple[int, int], float]:
    """(layer, logical expert) -> fingerprint, checking every copy on every rank agrees with the placement."""
    prints = llm.engine.executor.call("expert_fingerprint")  # per rank [L][local slots]
    phy2log = llm.engine.placement.phy2log
    per_rank = phy2log.shape[1] // len(prints)
    by_expert: dict[tuple[int, int], float] = {}
    for rank, fp in enumerate(prints):
        for layer, slots in enumerate(fp):
            assert len(slots) == per_rank
            for s, value in enumerate(slots):
                key = (layer, int(phy2log[layer, rank * per_rank + s]))
                assert torch.isclose(torch.tensor(by_expert.setdefault(key, value)), torch.tensor(value)), key
    return by_expert


def start_requests(llm: LLM, prompts, steps: int) -> list[str]:
    params = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)
    ids = []
    for p in prompts:
        ids.append(llm.engine.next_request_id())
        llm.engine.add_request(ids[-1], p, params)
    for _ in range(steps):
        llm.engine.step()
    return ids


def finish(llm: LLM, first: list) -> dict[str, tuple[str, list[int]]]:
    done = {o.request_id: (o.outputs[0].finish_reason, list(o.outputs[0].token_ids)) for o in first}
    while llm.engine.has_unfinished_requests() or llm.engine.needs_recovery:
        for out in llm.engine.step():
            if out.finished:
                done[out.request_id] = (out.outputs[0].finish_reason, list(out.outputs[0].token_ids))
    return done


def check_outcomes(done, ids, prompts, single) -> tuple[int, int]:
    """Every request finished: exact (retried or untouched) or with finish_reason "error"."""
    assert sorted(done) == sorted(ids)  # none lost
    failed = 0
    for request_id, expected in zip(ids, single):
        reason, tokens = done[request_id]
        if reason == "error":
            failed += 1
            assert tokens == expected[:len(tokens)] and tokens  # it had streamed these
        else:
            assert (reason, tokens) == ("length", expected), request_id
    return len(ids) - failed, failed


def test_kill_during_live_expert_migration(ep2):
    llm, prompts, single, reference = ep2
    engine = llm.engine
    faults = engine.supervisor.counters.num_worker_faults
    old = engine.placement.phy2log.clone()
    ids = start_requests(llm, prompts[:2], steps=2) + start_requests(llm, prompts[2:], steps=0)
    infos = engine.executor.infos
    kill(infos[1]["pid"], signal.SIGSTOP)  # rank 1 will not take part in the move...
    try:
        engine.request_rebalance()
        moved: list = []
        mover = threading.Thread(target=lambda: moved.extend(engine.rebalance_if_due()))
        mover.start()
        time.sleep(1.0)  # ...so rank 0 is inside the migration, waiting for rank 1
        assert mover.is_alive()
        killed_at = time.monotonic()
    finally:
        kill(infos[1]["pid"])
    mover.join(60)
    assert not mover.is_alive()
    assert engine.supervisor.counters.num_worker_faults == faults + 1
    assert torch.equal(engine.placement.phy2log, old)  # the move never committed
    done = finish(llm, moved)
    retried, failed = check_outcomes(done, ids, prompts, single)
    assert failed == 2 and retried == len(prompts) - 2
    assert expert_prints(llm) == pytest.approx(reference)  # every rank holds what the placement says
    report("SIGKILL rank 1 of EP2 during an expert migration (offline)", engine.supervisor.counters,
           killed_at, retried, failed, 0)
    # and a migration on the rebuilt group still works, token-exact
    engine.request_rebalance()
    assert greedy(llm, prompts) == single
    assert not torch.equal(engine.placement.phy2log, old)
    assert expert_prints(llm) == pytest.approx(reference)


def test_rank_stalled_in_a_collective_becomes_an_error_and_is_replaced(ep2):
    llm, prompts, single, _ = ep2
    engine = llm.engine
    ids = start_requests(llm, prompts[:3], steps=1) + start_requests(llm, prompts[3:], steps=0)
    pid = engine.executor.infos[1]["pid"]
    kill(pid, signal.SIGSTOP)
    stalled_at = time.monotonic()
    try:
        first = engine.step()  # rank 0 waits in the MoE all_to_all until collective_timeout_s
    finally:
        kill(pid)  # whatever happened, leave no stopped process behind
    waited = time.monotonic() - stalled_at
    assert 2.5 < waited < 30, waited
    fault = engine.supervisor.last_fault
    assert "rank 0" in fault and "all_to_all over the EP group" in fault, fault
    assert "collective_timeout_s=3s" in fault, fault
    done = finish(llm, first)
    retried, failed = check_outcomes(done, ids, prompts, single)
    assert failed == 3 and retried == len(prompts) - 3  # the first three had their first token
    assert engine.executor.infos[1]["pid"] != pid and engine.supervisor.state == "serving"
    assert greedy(llm, prompts) == single
    report("SIGSTOP rank 1 of EP2 in a collective (offline, collective_timeout_s=3)",
           engine.supervisor.counters, stalled_at, retried, failed, 0)


def check_blame(group, kill_rank: int, pid: int) -> float:
    """A survivor's collective that broke because its peer's connection closed (PeerGoneError)
    is reported as that peer's death, naming it, once Ray knows; a timed-out collective is
    left as reported. Kills ``pid`` (rank ``kill_rank``) on the way; returns when it did."""
    from launch.recovery import WorkerCallError, WorkerDiedError

    reported = "worker rank 0 on node 0 failed in execute: rank 0: layer 1 MoE all_to_all failed: a peer rank went away"
    peer_gone = WorkerCallError(reported, rank=0, detail="PeerGoneError")
    assert group.blame_dead_peer(peer_gone) is peer_gone  # nobody is dead: the reporter's error stands
    killed_at = time.monotonic()
    kill(pid)
    deadline = time.monotonic() + 30
    while not isinstance(blamed := group.blame_dead_peer(peer_gone), WorkerDiedError) and time.monotonic() < deadline:
        time.sleep(0.2)  # Ray may take a moment
    assert isinstance(blamed, WorkerDiedError) and blamed.rank == kill_rank, blamed
    assert blamed.summary.startswith(f"worker rank {kill_rank} on node 0") and "died" in blamed.summary
    assert blamed.detail.endswith(f"reported by {reported}")
    stalled = WorkerCallError("worker rank 0 ...: did not complete within ...", rank=0, detail="CollectiveError")
    assert group.blame_dead_peer(stalled) is stalled  # a timeout is not a closed connection: not re-blamed
    return killed_at


def test_degraded_mode_serves_on_the_survivor_then_restores(ray_local, hf_checkpoints):
    """recovery.degraded_mode (default): after rank 1 dies the engine serves at once on rank 0
    alone, every expert re-placed there, then takes the replacement back: token-exact throughout."""
    path = hf_checkpoints["deepseek_v3"]
    prompts = make_prompts(31, 6, 96)
    with LLM(str(path), dtype="float32") as llm:
        single = greedy(llm, prompts)
    llm = LLM(str(path), dtype="float32", data_parallel_size=2, enable_expert_parallel=True, enable_eplb=True,
              num_redundant_experts=2, eplb_config={"window_size": 1000, "step_interval": 100000},
              collective_timeout_s=5.0, recovery_config={"backoff_s": 0.0})
    try:
        engine = llm.engine
        assert greedy(llm, prompts) == single
        ids = start_requests(llm, prompts[:2], steps=2) + start_requests(llm, prompts[2:], steps=0)
        killed_at = check_blame(engine.executor.group, 1, engine.executor.infos[1]["pid"])
        first = engine.step()  # the fault: two requests had tokens and fail, four are requeued
        assert engine.supervisor.last_fault.startswith("worker rank 1 on node 0"), engine.supervisor.last_fault
        engine.step()  # rebuilt on the survivor
        counters = engine.supervisor.counters
        degraded_after = counters.last_recovery_seconds
        assert engine.recovery.is_degraded and engine.executor.group.num_ranks == 1
        assert engine.placement.num_gpus == 1 and engine.scheduler.config.dp_size == 1
        assert sorted({e for _, e in expert_prints(llm)}) == list(range(8))  # every expert on rank 0
        done = finish(llm, first)
        retried, failed = check_outcomes(done, ids, prompts, single)
        assert (retried, failed) == (4, 2)
        assert greedy(llm, prompts) == single
        deadline = time.monotonic() + 90
        while engine.recovery.is_degraded and time.monotonic() < deadline:
            time.sleep(0.2)
            engine.step()  # takes the replacement in once it is up
        restored_after = time.monotonic() - killed_at
        assert not engine.recovery.is_degraded, "the replacement never joined"
        assert engine.executor.group.num_ranks == 2 and engine.placement.num_gpus == 2
        assert engine.scheduler.config.dp_size == 2
        expert_prints(llm)
        assert greedy(llm, prompts) == single
        figures = report("SIGKILL rank 1 of EP2, degraded mode (offline)", counters, killed_at, retried, failed, 0)
        print("DEGRADED FIGURES " + json.dumps({**figures, "serving_degraded_s": round(degraded_after, 2),
                                                 "full_layout_s": round(restored_after, 1)}))
    finally:
        llm.shutdown()


def test_every_rank_hung_is_caught_by_the_driver_timeout(ep2):
    """No collective can time out when every rank is stopped: the driver's own bound on the
    call (recovery.step_timeout_s) names the ranks, and both are replaced."""
    llm, prompts, single, _ = ep2
    engine = llm.engine
    ids = start_requests(llm, prompts, steps=0)
    pids = [info["pid"] for info in engine.executor.infos]
    engine.executor.group.call_timeout_s = 2.0  # as recovery.step_timeout_s=2 would
    for pid in pids:
        kill(pid, signal.SIGSTOP)
    stalled_at = time.monotonic()
    try:
        first = engine.step()
    finally:
        for pid in pids:
            kill(pid)
        engine.executor.group.call_timeout_s = 36.0
    assert "ranks [0, 1] did not finish execute within 2s (recovery.step_timeout_s): hung" in \
        engine.supervisor.last_fault
    done = finish(llm, first)
    retried, failed = check_outcomes(done, ids, prompts, single)
    assert (retried, failed) == (len(prompts), 0)
    assert all(info["pid"] not in pids for info in engine.executor.infos)
    report("SIGSTOP both ranks of EP2 (offline, driver timeout 2 s)", engine.supervisor.counters, stalled_at,
           retried, failed, 0)
