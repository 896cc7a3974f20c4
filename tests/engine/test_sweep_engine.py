"""``launch sweep`` for real on a tiny skewed checkpoint in this process: rows, fidelity, drops."""

from __future__ import annotations

import json

import pytest

from launch.sweep import runner
from launch.sweep.report import read_rows
from moe.tiny import write_tiny_checkpoint


@pytest.mark.slow
def test_one_process_sweep_measures_and_agrees_with_the_baseline(tmp_path):
    model = write_tiny_checkpoint("deepseek_v3", tmp_path / "m", seed=1, router_skew=4.0)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt_token_ids": [0, 5 + i, 40 + 3 * i, 77, 9 + i]}) + "\n"
                               for i in range(3)))
    base = tmp_path / "base.yaml"
    base.write_text(f"model: {model}\nengine: {{dtype: float32, max_num_seqs: 4, memory: 64MiB}}\n")
    out = tmp_path / "out"
    args = ["--config", str(base), "--workload", str(prompts), "--max-tokens", "4", "--warmup-prompts", "1",
            "--out", str(out), "--no-progress", "--hardware", "none", "--grid", "moe.capacity_factor=[0,1.0]"]
    assert runner.main(args) == 0
    rows = {r["settings"]["moe.capacity_factor"]: r for r in read_rows(out / "results.jsonl")}
    assert set(rows) == {0, 1.0} and all(r["status"] == "ok" for r in rows.values())
    dropless, capped = rows[0], rows[1.0]
    assert dropless["greedy_agreement"] == 1.0 and dropless["drop_rate"] == 0.0  # same tokens as the baseline
    assert capped["drop_rate"] > 0  # skewed routing overflows capacity 1 token per expert
    for r in rows.values():
        assert r["num_output_tokens"] == 12 and r["num_decode_steps"] >= 3
        assert r["measured_step_ms"] > 0 and r["measured_step_cpu_ms"] > 0 and r["output_tokens_per_s"] > 0
        assert r["ttft_ms_p50"] <= r["ttft_ms_p99"] and r["tpot_ms_p50"] <= r["tpot_ms_p99"]
        assert r["kv_tokens"] > 0 and r["balancedness"] == 1.0 and r["ep_size"] == 1
        assert r["decode_batch_per_rank_p50"] == 3
    assert len(json.loads((out / "baseline.json").read_text())["outputs"]) == 3
