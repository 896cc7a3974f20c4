"""EP2 with ranks pinned to one core each, through ``launch sweep`` on Ray: EPLB on a skewed model."""

from __future__ import annotations

import json
import os

import pytest

from launch.config import load_runtime_config
from launch.sweep import runner
from launch.sweep.report import read_rows
from moe.tiny import write_tiny_checkpoint


@pytest.fixture(scope="module")
def skewed(tmp_path_factory):
    return write_tiny_checkpoint("deepseek_v3", tmp_path_factory.mktemp("skewed"), seed=2, router_skew=2.0)


@pytest.mark.slow
def test_ranks_are_pinned_to_distinct_cores(ray_local, skewed):
    from launch.engine import LLMEngine

    cfg = load_runtime_config(overrides=[f"model={skewed}", "parallel.data_parallel_size=2",
                                         "parallel.enable_expert_parallel=true", "parallel.enable_cpu_pinning=true",
                                         "engine.memory=64MiB"])
    engine = LLMEngine(cfg)
    try:
        infos = engine.executor.call("ping")
    finally:
        engine.shutdown()
    cpus = [info["cpus"] for info in infos]
    assert all(len(c) == 1 for c in cpus) and all(info["num_threads"] == 1 for info in infos)
    if len(os.sched_getaffinity(0)) >= 2:
        assert cpus[0] != cpus[1]


@pytest.mark.slow
def test_pinned_ep2_sweep_eplb_balances_the_skewed_load(ray_local, skewed, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt_token_ids": [0, *range(3 + i, 60 + i, 3)]}) + "\n"
                               for i in range(8)))
    base = tmp_path / "base.yaml"
    base.write_text(f"model: {skewed}\nparallel: {{data_parallel_size: 2, enable_expert_parallel: true, "
                    "enable_cpu_pinning: true}\nengine: {dtype: float32, max_num_seqs: 8, memory: 64MiB}\n")
    out = tmp_path / "out"
    assert runner.main(["--config", str(base), "--workload", str(prompts), "--max-tokens", "4", "--out", str(out),
                        "--no-progress", "--hardware", "none", "--warmup-prompts", "8",
                        "--grid", "balancer.enable_eplb,balancer.num_redundant_experts=[[false,0],[true,0],[true,2]]"
                        ]) == 0
    rows = {(r["settings"]["balancer.enable_eplb"], r["settings"]["balancer.num_redundant_experts"]): r
            for r in read_rows(out / "results.jsonl")}
    assert all(r["status"] == "ok" and r["ep_size"] == 2 for r in rows.values())
    off, on, redundant = rows[(False, 0)], rows[(True, 0)], rows[(True, 2)]
    assert off["balancedness"] < 0.9  # the skew lands on one rank under the identity placement
    assert on["balancedness"] > off["balancedness"] and redundant["balancedness"] > off["balancedness"]
    assert all(r["measured_step_cpu_ms"] > 0 and r["num_output_tokens"] == 32 for r in rows.values())
