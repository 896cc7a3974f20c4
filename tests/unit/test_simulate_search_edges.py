"""``simulate --search`` on clusters and models other than the documented ones."""

from __future__ import annotations

from pathlib import Path

import pytest

from launch.hardware import load_hardware
from launch.simulate import main
from moe.config import ModelConfig
from parallel.costmodel import Deployment
from parallel.costmodel.search import SLO, enumerate_layouts, search_layouts

ROOT = Path(__file__).resolve().parents[2]
MIXTRAL = ModelConfig.from_hf("mistralai/Mixtral-8x7B-v0.1", strict=False)


def test_gpus_per_node_that_tp_does_not_divide_gives_valid_layouts():
    # 3 GPUs per node: TP2 would leave a 2-rank world that EP3 cannot split (it raised)
    layouts = enumerate_layouts(MIXTRAL, 2, 3, Deployment())
    assert layouts and {d.tp for d in layouts} == {1}
    for d in layouts:
        assert d.world_size == 3 * d.num_nodes and d.world_size % d.ep == 0
    ranked = search_layouts(MIXTRAL, load_hardware("h100"), num_nodes=1, gpus_per_node=6, slo=SLO(),
                            input_len=100, output_len=10)
    assert {c.deployment.tp for c in ranked} == {1, 2}


def test_the_last_batch_of_the_grid_is_not_reported_as_exceeding_the_slo():
    ranked = search_layouts(MIXTRAL, load_hardware("b200"), num_nodes=1, gpus_per_node=8,
                            slo=SLO(tpot_ms=1e9), input_len=16, output_len=16,
                            base=Deployment(max_num_seqs=4096))
    top = ranked[0]
    assert top.feasible and top.batch_size == 1024
    assert "would exceed" not in top.bound and top.bound == "batch grid end"


def _write(tmp_path, text: str):
    path = tmp_path / "hw.yaml"
    path.write_text(text)
    return path


@pytest.mark.parametrize(("text", "message"), [
    ("name: x\n", "missing required key(s) ['flops', 'memory_bandwidth', 'memory_bytes']"),
    ("name: x\nflops: {bf16: 1e15}\nmemory_bandwidth: 3e12\nmemory_bytes: 80GiB\n", "memory_bytes: '80GiB'"),
    ("name: x\nflops: {bf16: fast}\nmemory_bandwidth: 3e12\nmemory_bytes: 80e9\n", "flops.bf16: 'fast'"),
    ("name: x\nflops: [1]\nmemory_bandwidth: 3e12\nmemory_bytes: 80e9\n", "flops: expected a mapping"),
])
def test_incomplete_hardware_files_are_named_not_a_traceback(tmp_path, capsys, text, message):
    assert main(["--config", str(ROOT / "configs/mixtral-8x7b-ep8.yaml"), "--hardware", str(_write(tmp_path, text))]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1, err


def test_multi_node_layout_on_hardware_without_a_network_is_refused_by_name(tmp_path, capsys):
    hw = _write(tmp_path, "name: x\nflops: {bf16: 1e15}\nmemory_bandwidth: 3e12\nmemory_bytes: 80e9\n")
    assert main(["--config", str(ROOT / "configs/deepseek-v3-decode-ep144.yaml"), "--hardware", str(hw)]) == 2
    err = capsys.readouterr().err.strip()
    assert "inter_node_bandwidth" in err and len(err.splitlines()) == 1, err
    assert main(["--config", str(ROOT / "configs/mixtral-8x7b-ep8.yaml"), "--hardware", str(hw)]) == 0  # one node


def test_a_kv_cache_capped_by_num_kv_blocks_is_not_blamed_on_the_weights(capsys):
    assert main(["--config", str(ROOT / "configs/mixtral-8x7b-ep8.yaml"), "--hardware", "h100",
                 "--set", "engine.num_kv_blocks=10"]) == 2
    err = capsys.readouterr().err.strip()
    assert "engine.num_kv_blocks=10 x block_size=16 hold 160 KV tokens" in err, err
    assert "weights" not in err and len(err.splitlines()) == 1


def test_the_search_offers_only_tp_degrees_the_runtime_takes_for_the_kv_heads():
    """The runtime refuses a TP degree that neither divides nor is a multiple of the kv heads
    (launch.config.validate_for_model): 6 query heads over 3 kv heads leave TP 1 and 3, not 2."""
    from dataclasses import replace

    odd = replace(MIXTRAL, num_attention_heads=6, num_key_value_heads=3)
    assert {d.tp for d in enumerate_layouts(odd, 1, 8, Deployment())} == {1}  # 3 does not divide 8 GPUs
    assert {d.tp for d in enumerate_layouts(MIXTRAL, 1, 8, Deployment())} == {1, 2, 4, 8}  # 8 kv heads
    assert {d.tp for d in enumerate_layouts(replace(MIXTRAL, num_key_value_heads=2), 1, 16, Deployment())} == \
        {1, 2, 4, 8, 16}  # multiples of the kv heads: each rank holds a copy
