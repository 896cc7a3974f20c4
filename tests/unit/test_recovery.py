"""Worker-fault policy without processes: the supervisor's state machine and backoff, the
scheduler's requeue-or-fail after a fault, the engine's rebuild on an in-process executor
that fails on cue, and the HTTP face of a recovering or dead engine (503 with the reason)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import httpx
import pytest

from launch.config import RecoveryConfig, RuntimeConfig
from launch.core import BlockAllocator, SamplingParams, Scheduler, SchedulerConfig
from launch.recovery import (
    DEAD,
    RECOVERING,
    SERVING,
    EngineDeadError,
    EngineRecoveringError,
    Supervisor,
    WorkerCallError,
    WorkerDiedError,
    WorkerFault,
)

# ---- supervisor --------------------------------------------------------------------------


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0
        self.slept: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


def supervisor(**config) -> tuple[Supervisor, FakeClock]:
    clock = FakeClock()
    return Supervisor(RecoveryConfig(**config), clock=clock, sleep=clock.sleep), clock


def test_fault_recover_and_backoff_doubles_per_fault_in_window():
    sup, clock = supervisor(max_restarts=3, backoff_s=0.5, max_backoff_s=1.5, restart_window_s=60)
    for expected in (0.5, 1.0, 1.5):
        sup.on_fault(WorkerDiedError("worker rank 1 died (its process exited)", rank=1, detail="ray text"))
        assert sup.state == RECOVERING and sup.reason == "worker rank 1 died (its process exited); engine recovering"
        with pytest.raises(EngineRecoveringError, match="rank 1 died"):
            sup.check_serving()
        sup.next_attempt()
        assert clock.slept[-1] == expected
        clock.now += 2.0
        assert sup.on_recovered() == pytest.approx(expected + 2.0)
        assert sup.state == SERVING and sup.reason == ""
        sup.check_serving()
    assert sup.counters.num_recoveries == 3 and sup.counters.num_worker_faults == 3
    # a fourth fault within the window: the worker keeps dying, the engine stops for good
    sup.on_fault(WorkerDiedError("worker rank 1 died (its process exited)", rank=1))
    with pytest.raises(EngineDeadError, match=r"4 worker faults within 60s \(recovery.max_restarts=3\)"):
        sup.next_attempt()
    assert sup.state == DEAD
    with pytest.raises(EngineDeadError, match="rank 1 died"):
        sup.check_serving()


def test_faults_outside_the_window_are_forgotten():
    sup, clock = supervisor(max_restarts=1, backoff_s=0.0, restart_window_s=10)
    for _ in range(3):
        sup.on_fault(WorkerDiedError("worker rank 0 died", rank=0))
        sup.next_attempt()
        sup.on_recovered()
        clock.now += 11.0
    assert sup.counters.num_recoveries == 3 and sup.state == SERVING


def test_failed_rebuilds_count_as_faults_and_recovery_can_be_off():
    sup, _ = supervisor(max_restarts=2, backoff_s=0.0)
    sup.on_fault(WorkerCallError("worker rank 1 failed in execute: collective timed out", rank=1))
    sup.next_attempt()
    sup.on_attempt_failed(RuntimeError("placement group not ready"))
    sup.next_attempt()
    sup.on_attempt_failed(RuntimeError("placement group not ready"))
    with pytest.raises(EngineDeadError, match="3 worker faults"):
        sup.next_attempt()
    off, _ = supervisor(enable_recovery=False)
    off.on_fault(WorkerDiedError("worker rank 1 died", rank=1))
    assert off.state == DEAD and "recovery.enable_recovery=false" in off.reason


def test_retry_policy_nothing_generated_and_retries_left():
    sup, _ = supervisor(max_request_retries=1)
    assert sup.may_retry("a", 0) and not sup.may_retry("b", 3)
    sup.on_requests_reset(["a"], ["b"])
    assert not sup.may_retry("a", 0)  # its one retry is spent
    assert sup.counters.num_requests_retried == 1 and sup.counters.num_requests_failed == 1
    sup.forget_request("a")
    assert sup.may_retry("a", 0)


@pytest.mark.parametrize("bad", [dict(max_restarts=-1), dict(backoff_s=5.0, max_backoff_s=1.0),
                                 dict(step_timeout_s=0), dict(restart_window_s=0)])
def test_recovery_config_is_validated(bad):
    with pytest.raises(ValueError):
        RecoveryConfig(**bad)
    with pytest.raises(Exception, match=next(iter(bad))):
        RuntimeConfig.from_dict({"model": "m", "recovery": bad})


def test_worker_fault_pickles_with_its_fields():
    import pickle

    err = pickle.loads(pickle.dumps(WorkerDiedError("worker rank 2 died", rank=2, detail="d")))
    assert (str(err), err.rank, err.detail) == ("worker rank 2 died", 2, "d")


# ---- scheduler ---------------------------------------------------------------------------


def make_scheduler(num_blocks: int = 16) -> Scheduler:
    cfg = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64, dp_size=2, block_size=4)
    return Scheduler(cfg, [BlockAllocator(num_blocks, 4) for _ in range(2)])


def test_reset_after_fault_requeues_fresh_requests_and_fails_the_rest():
    sched = make_scheduler()
    params = SamplingParams(max_tokens=5, ignore_eos=True)
    for i in range(3):
        sched.add_request(f"r{i}", [1, 2, 3, 4, 5, 6], params)
    out = sched.schedule()
    sched.update(out, [[7] * len(b.sample_rows) for b in out.batches])  # r0..r2 have one token each
    sched.add_request("late", [9, 9, 9, 9, 9], params)
    sched.schedule()  # a step in flight when the fault hits: never updated
    assert sum(sched.stats().kv_cache_usage) > 0
    fresh = [BlockAllocator(16, 4) for _ in range(2)]
    retried, failed = sched.reset_after_fault(fresh, lambda r: sum(s.num_output_tokens for s in r.seqs) == 0)
    assert retried == ["late"]
    assert sorted(o.request_id for o in failed) == ["r0", "r1", "r2"]
    assert all(o.finished and o.outputs[0].finish_reason == "error" and o.outputs[0].token_ids == [7]
               for o in failed)
    assert sched.allocators == fresh and sched.stats().kv_cache_usage == (0.0, 0.0)
    assert (sched.num_running, sched.num_waiting) == (0, 1)
    out = sched.schedule()  # the retried request prefills its whole prompt from scratch
    rows = [s for b in out.batches for s in b.seqs]
    assert [(s.request_id, s.num_computed_tokens, len(s.token_ids)) for s in rows] == [("late", 0, 5)]
    sched.update(out, [[8] * len(b.sample_rows) for b in out.batches])
    assert sched.get_request("late").seqs[0].output_token_ids == [8]


# ---- engine, in process ------------------------------------------------------------------


class FlakyExecutor:
    """The in-process executor, failing ``execute`` on the calls listed in ``fail_on`` (1-based)
    as a dead rank 1 would; ``restart`` builds a fresh one, as the Ray executor does."""

    num_nodes = 1

    def __init__(self, inner, fail_on=(), fail_restarts: int = 0) -> None:
        self.inner, self.fail_on, self.fail_restarts = inner, set(fail_on), fail_restarts
        self.calls = self.restarts = 0

    def execute(self, output, collect_load):
        self.calls += 1
        if self.calls in self.fail_on:
            raise WorkerDiedError("worker rank 1 on node 0 died (its process exited)", rank=1,
                                  detail="actor_id=abc pid=123 namespace=xyz")
        return self.inner.execute(output, collect_load)

    def restart(self, phy2log):
        import dataclasses

        from launch.executor import LocalExecutor

        self.restarts += 1
        if self.restarts <= self.fail_restarts:
            raise RuntimeError("placement group not ready")
        spec = dataclasses.replace(self.inner.worker.spec, phy2log=phy2log)
        self.inner.shutdown()
        self.inner = LocalExecutor(spec)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def engine_config(tiny, **recovery) -> RuntimeConfig:
    return RuntimeConfig.from_dict({
        "model": str(tiny), "engine": {"dtype": "float32", "max_model_len": 64, "num_kv_blocks": 32,
                                       "block_size": 4, "max_num_seqs": 4},
        "recovery": {"backoff_s": 0.0, **recovery}})


def run_all(engine, requests: dict[str, list[int]], params: SamplingParams) -> dict[str, tuple]:
    for request_id, ids in requests.items():
        engine.add_request(request_id, ids, params)
    done = {}
    while engine.has_unfinished_requests() or engine.needs_recovery:
        for out in engine.step():
            if out.finished:
                done[out.request_id] = (out.outputs[0].finish_reason, out.outputs[0].token_ids)
    return done


@pytest.mark.slow
def test_engine_requeues_fails_rebuilds_and_stays_token_exact(tiny_ckpt):
    from launch.engine import LLMEngine

    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    prompts = {f"p{i}": [3 + i, 5, 7, 11 + i] for i in range(4)}
    engine = LLMEngine(engine_config(tiny_ckpt))
    try:
        clean = run_all(engine, prompts, params)
        engine.executor = FlakyExecutor(engine.executor, fail_on={3})
        for request_id in ("p0", "p1"):  # these have tokens when step 3 fails
            engine.add_request(f"early-{request_id}", prompts[request_id], params)
        engine.step()
        engine.step()
        late = {f"late-{k}": v for k, v in prompts.items() if k in ("p2", "p3")}
        done = run_all(engine, late, params)
        assert done["early-p0"] == ("error", clean["p0"][1][:2]) and done["early-p1"][0] == "error"
        assert done["late-p2"] == clean["p2"] and done["late-p3"] == clean["p3"]  # retried, exact
        assert engine.executor.restarts == 1 and engine.supervisor.state == SERVING
        c = engine.supervisor.counters
        assert (c.num_worker_faults, c.num_recoveries, c.num_requests_retried, c.num_requests_failed) == (1, 1, 2, 2)
        stats = engine.scheduler.stats()
        assert (stats.num_running, stats.num_waiting, sum(stats.kv_cache_usage)) == (0, 0, 0.0)
        assert run_all(engine, prompts, params) == clean  # and after recovery
    finally:
        engine.shutdown()


@pytest.mark.slow
def test_engine_stops_when_rebuilds_keep_failing(tiny_ckpt):
    from launch.engine import LLMEngine

    engine = LLMEngine(engine_config(tiny_ckpt, max_restarts=2))
    try:
        engine.executor = FlakyExecutor(engine.executor, fail_on={1}, fail_restarts=5)
        engine.add_request("a", [3, 4, 5], SamplingParams(max_tokens=3))
        assert engine.step() == [] and engine.needs_recovery  # requeued, nothing failed
        with pytest.raises(EngineDeadError, match="rank 1 on node 0 died .*3 worker faults"):
            engine.step()
        assert engine.supervisor.state == DEAD and engine.executor.restarts == 2
    finally:
        engine.shutdown()


# ---- HTTP --------------------------------------------------------------------------------


class FaultyEngine:
    """FakeEngine whose generate fails with ``error`` after ``after`` outputs."""

    def __new__(cls, error: BaseException, after: int):
        from tests.unit.server_fakes import FakeEngine

        class _Engine(FakeEngine):
            async def generate(self, prompt_token_ids, params, request_id):
                n = 0
                async for out in FakeEngine.generate(self, prompt_token_ids, params, request_id):
                    if n == after:
                        raise error
                    n += 1
                    yield out

            async def check_health(self):
                raise error

        return _Engine()


def server_config():
    return SimpleNamespace(api_key=None, served_model_name=None, max_queue_len=8, expert_distribution_dir=None)


@pytest.mark.parametrize("error,retry_after", [
    (EngineRecoveringError("worker rank 1 on node 0 died (its process exited); engine recovering"), "5"),
    (EngineDeadError("worker rank 1 died; 4 worker faults within 600s: engine stopped"), None),
])
def test_recovering_or_dead_engine_answers_503_with_the_reason(error, retry_after):
    from launch.server import build_app
    from tests.unit.server_fakes import ServerThread

    with ServerThread(build_app(FaultyEngine(error, after=0), server_config())) as srv:
        for r in (httpx.get(srv.base_url + "/health"),
                  httpx.post(srv.base_url + "/v1/completions", json={"prompt": "q", "max_tokens": 4}),
                  httpx.post(srv.base_url + "/v1/completions", json={"prompt": "q", "stream": True})):
            assert r.status_code == 503, r.text
            body = r.json()["error"]
            assert body["type"] == "service_unavailable" and body["code"] == 503 and "rank 1" in body["message"]
            assert r.headers.get("retry-after") == retry_after
        assert 'moe:requests_rejected_total{model_name="fake-moe",status="503"} 2.0' in \
            httpx.get(srv.base_url + "/metrics").text


def test_stream_that_already_sent_tokens_gets_an_error_event_then_done():
    from launch.server import build_app
    from tests.unit.server_fakes import ServerThread

    error = EngineRecoveringError("worker rank 1 died (its process exited); engine recovering")
    with ServerThread(build_app(FaultyEngine(error, after=2), server_config())) as srv:
        r = httpx.post(srv.base_url + "/v1/completions", json={"prompt": "q", "max_tokens": 8, "stream": True})
        assert r.status_code == 200
        events = [line[len("data: "):] for line in r.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        last = json.loads(events[-2])["error"]
        assert last["code"] == 503 and "rank 1 died" in last["message"]
        assert len(events) >= 4  # two token chunks before the error


@pytest.mark.parametrize("stream", [False, True])
def test_a_request_a_worker_fault_ended_counts_as_finished_reason_error(stream):
    """docs/server.md: one the engine ends with finish_reason "error" counts as finished_reason="error";
    an engine refusing a request (503 at admission) is no finished request."""
    from launch.server import build_app
    from tests.unit.server_fakes import ServerThread

    ended = EngineRecoveringError("worker rank 1 died (its process exited); this request had already produced output")
    ended.finish_reason = "error"  # as AsyncLLM._as_error marks it
    with ServerThread(build_app(FaultyEngine(ended, after=2), server_config())) as srv:
        httpx.post(srv.base_url + "/v1/completions", json={"prompt": "q", "max_tokens": 8, "stream": stream})
        metrics = httpx.get(srv.base_url + "/metrics").text
    assert 'vllm:request_success_total{finished_reason="error",model_name="fake-moe"} 1.0' in metrics
    refused = EngineRecoveringError("worker rank 1 died (its process exited); engine recovering")
    with ServerThread(build_app(FaultyEngine(refused, after=0), server_config())) as srv:
        httpx.post(srv.base_url + "/v1/completions", json={"prompt": "q", "max_tokens": 8, "stream": stream})
        metrics = httpx.get(srv.base_url + "/metrics").text
    assert 'vllm:request_success_total{finished_reason="error",model_name="fake-moe"} 0.0' in metrics


def test_a_failed_requests_error_says_recovering_once_or_stopped():
    from launch.async_llm import AsyncLLM
    from launch.core.outputs import CompletionOutput, RequestOutput

    sup, _ = supervisor(max_restarts=1)
    sup.on_fault(WorkerFault("worker rank 1 died (its process exited)", rank=1))
    llm = SimpleNamespace(engine=SimpleNamespace(supervisor=sup))
    out = RequestOutput("r", None, [1], [CompletionOutput(0, "x", [5], finish_reason="error")], finished=True)
    error = AsyncLLM._as_error(llm, out)
    assert isinstance(error, EngineRecoveringError) and error.finish_reason == "error"
    assert str(error).count("recovering") == 0 and "rank 1 died" in str(error)  # the 503 says "recovering" once
    sup.stop("worker rank 1 died; 2 worker faults within 600s (recovery.max_restarts=1): engine stopped")
    assert isinstance(AsyncLLM._as_error(llm, out), EngineDeadError)  # no "send it again" to a stopped engine


def test_reset_after_fault_moves_requests_onto_fewer_or_more_ranks():
    sched = make_scheduler()
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    for i in range(4):
        sched.add_request(f"r{i}", [1, 2, 3, 4, 5], params)
    out = sched.schedule()
    assert sorted(b.dp_rank for b in out.batches if b.seqs) == [0, 1]
    sched.update(out, [[7] * len(b.sample_rows) for b in out.batches])
    retried, failed = sched.reset_after_fault([BlockAllocator(16, 4)], lambda r: True)  # degraded: one rank
    assert sorted(retried) == ["r0", "r1", "r2", "r3"] and failed == []
    assert sched.config.dp_size == 1 and len(sched.allocators) == 1
    out = sched.schedule()
    assert len(out.batches) == 1 and len(out.batches[0].seqs) == 4  # recomputed with their token
    assert all(s.num_computed_tokens == 0 and len(s.token_ids) == 6 for s in out.batches[0].seqs)
    sched.update(out, [[8] * 4])
    sched.reset_after_fault([BlockAllocator(16, 4) for _ in range(2)], lambda r: True)  # restored
    out = sched.schedule()
    assert len(out.batches) == 2 and sum(len(b.seqs) for b in out.batches) == 4
    sched.update(out, [[9] * len(b.sample_rows) for b in out.batches])
    assert sched.get_request("r0").seqs[0].output_token_ids == [7, 8, 9]


@pytest.mark.parametrize("experts,redundant,ranks,survivors,slots", [
    (8, 0, 2, 1, 8),  # no redundancy: the survivor takes every expert
    (8, 4, 4, 3, 9),  # 3 slots each still hold all 8 experts: the redundant slots absorb the loss
    (8, 0, 4, 3, 9),  # 2 slots each would not: grow to ceil(8 / 3) = 3
])
def test_degraded_placement_covers_every_expert_on_the_survivors(experts, redundant, ranks, survivors, slots):
    import torch

    from balancer import Placement
    from launch.recovery import compute_degraded_placement

    full = Placement.identity(3, experts, redundant, ranks)
    load = torch.arange(3 * experts, dtype=torch.float32).reshape(3, experts)
    degraded = compute_degraded_placement(full, load, survivors, num_groups=4)
    assert degraded.num_gpus == survivors and tuple(degraded.phy2log.shape) == (3, slots)
    assert (degraded.logcnt >= 1).all() and int(degraded.logcnt.sum()) == 3 * slots
    uniform = compute_degraded_placement(full, None, survivors)
    assert (uniform.logcnt >= 1).all()

