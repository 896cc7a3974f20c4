"""The expert-distribution record: bounded (ring buffer, dropped steps counted and exposed as a
metric), one writer with unique names, and the balancing driver's record -> dump path read back."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from balancer import BalancerConfig, Placement
from launch.balancing import EplbDriver
from launch.config import ServerConfig
from launch.expert_location import (
    DUMP_FORMAT,
    ExpertDistributionRecorder,
    read_expert_distribution_dump,
    write_expert_distribution_dump,
)

L, E, P, R = 2, 4, 6, 2
PHY2LOG = torch.tensor([[0, 1, 2, 3, 0, 1], [3, 2, 1, 0, 3, 3]])


def placement() -> Placement:
    return Placement.from_phy2log(PHY2LOG, E, R)


def step_load(i: int) -> torch.Tensor:
    """[L, P] int64 per-slot loads of step i (distinct per step)."""
    return torch.arange(L * P, dtype=torch.int64).reshape(L, P) + 100 * i


def metadata(path: Path) -> dict[str, str]:
    with safe_open(str(path), "pt") as f:
        return f.metadata()


def test_buffer_keeps_the_newest_steps_and_counts_the_rest(tmp_path):
    rec = ExpertDistributionRecorder(buffer_size=3)
    rec.record(torch.ones(L, E), torch.ones(L, P))  # not recording: ignored
    assert rec.num_steps == 0
    rec.start()
    for i in range(5):
        rec.record(torch.full((L, E), i), torch.full((L, P), i), torch.full((L,), i))
    assert rec.num_steps == 3 and rec.num_steps_dropped == 2
    path = rec.dump(tmp_path, placement())
    t = read_expert_distribution_dump(path)
    assert t["logical_count"].shape == (3, L, E) and t["logical_count"].dtype == torch.int64
    assert t["logical_count"][:, 0, 0].tolist() == [2, 3, 4]  # the oldest two went
    assert t["physical_count"].shape == (3, L, P) and t["dropped_count"].shape == (3, L)
    assert metadata(path)["steps_dropped"] == "2" and metadata(path)["format"] == DUMP_FORMAT
    # The dump empties the buffer; recording goes on; the dropped counter is monotonic.
    assert rec.num_steps == 0 and rec.is_recording
    for i in range(4):
        rec.record(torch.full((L, E), i), torch.full((L, P), i))
    assert rec.num_steps_dropped == 3
    second = rec.dump(tmp_path, placement())
    assert metadata(second)["steps_dropped"] == "1"
    assert "dropped_count" not in read_expert_distribution_dump(second)  # dropless steps only


def test_unbounded_and_invalid_sizes():
    rec = ExpertDistributionRecorder(buffer_size=-1)
    rec.start()
    for _ in range(2500):
        rec.record(torch.zeros(L, E), torch.zeros(L, P))
    assert rec.num_steps == 2500 and rec.num_steps_dropped == 0
    for bad in (0, -2, 1.5, True):
        with pytest.raises(ValueError, match="buffer size must be >= 1 or -1"):
            ExpertDistributionRecorder(buffer_size=bad)
    assert ServerConfig().expert_distribution_recorder_buffer_size == 1000
    assert ServerConfig(expert_distribution_recorder_buffer_size=-1).expert_distribution_recorder_buffer_size == -1
    with pytest.raises(ValueError, match="expert_distribution_recorder_buffer_size must be >= 1"):
        ServerConfig(expert_distribution_recorder_buffer_size=0)


def test_buffer_memory_is_bounded():
    """Steps are int32 and at most buffer_size of them stay: 4 x L x (E + P) bytes each."""
    rec = ExpertDistributionRecorder(buffer_size=10)
    rec.start()
    for _ in range(100):
        rec.record(torch.zeros(58, 256, dtype=torch.int64), torch.zeros(58, 288, dtype=torch.int64))
    held = sum(t.numel() * t.element_size() for step in rec._steps for t in step if t is not None)
    assert rec.num_steps == 10 and held == 10 * 4 * 58 * (256 + 288)


def test_same_second_same_steps_dumps_do_not_overwrite(tmp_path):
    count = torch.ones(3, L, E, dtype=torch.int64)
    paths = [write_expert_distribution_dump(tmp_path, count * k, PHY2LOG) for k in range(1, 21)]
    assert len(set(paths)) == 20 and len(list(tmp_path.glob("*.safetensors"))) == 20
    assert not list(tmp_path.glob(".*partial"))  # written under a temporary name, then renamed
    for k, path in enumerate(paths, 1):
        assert path.name.startswith("expert_distribution_") and "_3steps_" in path.name
        assert int(read_expert_distribution_dump(path)["logical_count"][0, 0, 0]) == k


def test_writer_checks_shapes(tmp_path):
    count = torch.ones(2, L, E, dtype=torch.int64)
    with pytest.raises(ValueError, match="logical_count must be"):
        write_expert_distribution_dump(tmp_path, count[0])
    with pytest.raises(ValueError, match="physical_count must be"):
        write_expert_distribution_dump(tmp_path, count, PHY2LOG, physical_count=torch.ones(2, L, P + 1))
    with pytest.raises(ValueError, match="dropped_count must be"):
        write_expert_distribution_dump(tmp_path, count, dropped_count=torch.ones(3, L))


def test_driver_record_to_dump_round_trip(tmp_path):
    """Slot loads -> logical counts under the placement in force -> dump -> read back."""
    driver = EplbDriver(BalancerConfig(), placement(), num_groups=1, num_nodes=1, expert_bytes=8,
                        record_buffer_size=2)
    driver.record(step_load(0))  # before start: statistics only
    driver.start_record()
    for i in range(1, 4):
        driver.record(step_load(i), torch.tensor([i, 0]))
    driver.stop_record()
    driver.record(step_load(9))  # after stop: not recorded
    assert driver.recorder.num_steps_dropped == 1
    path = driver.dump_record(tmp_path, metadata={"phases": "[]"})
    t = read_expert_distribution_dump(path)
    want = torch.stack([torch.zeros(L, E, dtype=torch.int64).scatter_add_(1, PHY2LOG, step_load(i))
                        for i in (2, 3)])
    assert torch.equal(t["logical_count"], want)
    assert torch.equal(t["physical_count"], torch.stack([step_load(2), step_load(3)]))
    assert t["dropped_count"].tolist() == [[2, 0], [3, 0]]
    assert torch.equal(t["phy2log"], PHY2LOG) and int(t["num_gpus"]) == R
    assert metadata(path)["phases"] == "[]" and metadata(path)["steps_dropped"] == "1"
    assert driver.stats.num_steps == 5  # the statistics window saw every step


def test_metrics_expose_buffered_and_dropped_steps():
    from launch.async_llm import EngineStats
    from launch.server.metrics import ServerMetrics

    stats = EngineStats(expert_distribution_steps_buffered=7, expert_distribution_steps_dropped=42)
    text = ServerMetrics("m", stats=lambda: stats).exposition().decode()
    assert 'moe:expert_distribution_steps_dropped_total{model_name="m"} 42.0' in text
    assert 'moe:expert_distribution_steps_buffered{model_name="m"} 7.0' in text


@pytest.mark.parametrize("owned", [False, True])
def test_run_totals_count_every_step_across_a_rebalance(owned):
    """The run's totals (tokens per EP rank [L, R], per logical expert [L, E]) take every step under the
    placement in force at it, and a rebalance leaves them: the window starts over, they do not."""
    driver = EplbDriver(BalancerConfig(), placement(), num_groups=1, num_nodes=1, expert_bytes=8)
    rank0, logical0 = driver.run_totals()
    assert rank0.shape == (L, R) and logical0.shape == (L, E) and not rank0.any() and not logical0.any()
    for i in range(3):
        driver.record(step_load(i), owned=owned)
    swapped = Placement.from_phy2log(PHY2LOG.flip(1), E, R)  # every slot's expert moves to the other rank
    new, plan, _ = driver.plan_rebalance()
    driver.commit(swapped, plan, 0.0)
    assert driver.stats.num_steps == 0  # the window starts over
    for i in range(3, 5):
        driver.record(step_load(i), owned=owned)
    rank, logical = driver.run_totals()
    want_rank = torch.zeros(L, R, dtype=torch.float64)
    want_logical = torch.zeros(L, E, dtype=torch.int64)
    for i in range(5):
        phy2log = PHY2LOG if i < 3 else PHY2LOG.flip(1)
        load = step_load(i)
        want_rank += load.view(L, R, P // R).sum(-1).double()
        want_logical += torch.zeros(L, E, dtype=torch.int64).scatter_add_(1, phy2log, load)
    assert torch.equal(rank, want_rank) and torch.equal(logical, want_logical)
    assert int(logical.sum()) == int(sum(step_load(i).sum() for i in range(5)))


def test_metrics_carry_each_ranks_tokens_per_layer_and_the_checks_that_stayed():
    """/metrics: moe:expert_rank_tokens_total{layer, rank} (the run's totals, which a rebalance leaves:
    balancedness over any interval from their increase) and the balancer's checks that kept the
    placement, with their planning seconds."""
    from launch.async_llm import EngineStats
    from launch.server.metrics import ServerMetrics

    driver = EplbDriver(BalancerConfig(), placement(), num_groups=1, num_nodes=1, expert_bytes=8)
    for i in range(2):
        driver.record(step_load(i), owned=True)
    assert not driver.run_totals(applied=True)[0].any()  # pending steps: a per-step snapshot forces nothing
    rank_tokens = driver.run_totals()[0]
    driver.stay(0.125)
    driver.stay(0.25)
    c = driver.counters
    stats = EngineStats(expert_rank_tokens=rank_tokens, num_rebalance_stays=c.num_stays,
                        rebalance_stay_seconds_total=c.stay_seconds_total)
    text = ServerMetrics("m", stats=lambda: stats, moe_layer_ids=(1, 3)).exposition().decode()
    for layer, lid in enumerate((1, 3)):
        for rank in range(R):
            want = float(rank_tokens[layer, rank])
            assert f'moe:expert_rank_tokens_total{{layer="{lid}",model_name="m",rank="{rank}"}} {want}' in text
    assert "# TYPE moe:expert_rank_tokens_total counter" in text or "# TYPE moe:expert_rank_tokens counter" in text
    assert 'moe:rebalance_stays_total{model_name="m"} 2.0' in text
    assert 'moe:rebalance_stay_seconds_total{model_name="m"} 0.375' in text


def test_a_check_that_keeps_the_placement_is_counted_with_its_seconds():
    """One EP rank balances any placement: the forecast keeps the one in force. That check planned in the
    engine's step: counted (num_stays, stay_seconds_total) and in the stats the server exposes; the rank
    tokens count the steps run."""
    from launch import LLM
    from launch.async_llm import snapshot_stats
    from launch.core import SamplingParams
    from launch.workloads import SHIPPED_MODEL

    with LLM(str(SHIPPED_MODEL), dtype="float32", enable_expert_parallel=True, enable_eplb=True,
             num_redundant_experts=2, memory="512MiB") as llm:
        llm.generate({"prompt_token_ids": [5, 6, 7, 8]}, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
        before = llm.engine.placement.phy2log.clone()
        out = llm.engine.rebalance()
        assert out["copies_moved"] == 0 and torch.equal(llm.engine.placement.phy2log, before)
        c = llm.engine.eplb.counters
        assert (c.num_rebalances, c.num_stays) == (0, 1) and c.stay_seconds_total == out["seconds"] > 0
        stats = snapshot_stats(llm.engine)
        assert (stats.num_rebalance_stays, stats.rebalance_stay_seconds_total) == (1, out["seconds"])
        moe_layers = len(llm.engine.model_config.moe_layer_ids)
        assert tuple(stats.expert_rank_tokens.shape) == (moe_layers, 1)
        top_k = llm.engine.model_config.num_experts_per_tok
        assert stats.expert_rank_tokens.sum() == moe_layers * top_k * (4 + 2)  # prefill 4 tokens, then 2 decode
