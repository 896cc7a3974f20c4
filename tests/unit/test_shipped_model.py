"""The trained checkpoint shipped at launch/data/models/tiny-dsv3 (the default of ``make run``):
small, DeepSeek-V3 routing with a trained bias, reads better than random weights, routes
unevenly and differently per kind of text, and loads token-exact in the engine and transformers."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from launch.tokenizer import Tokenizer
from launch.training.model import TrainableMoE, load_trained
from launch.training.report import routing_report, workload_load
from launch.training.train import build_train_config
from launch.workloads import load_workload
from moe.config import ModelConfig

SHIPPED = Path(__file__).resolve().parents[2] / "launch" / "data" / "models" / "tiny-dsv3"


@pytest.fixture(autouse=True)
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def trained() -> TrainableMoE:
    return load_trained(SHIPPED)


def test_files_size_and_config() -> None:
    names = {p.name for p in SHIPPED.iterdir()}
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
            "tokenizer_config.json", "training.json"} <= names
    assert sum(p.stat().st_size for p in SHIPPED.iterdir()) <= 10 * 1024**2
    cfg = json.loads((SHIPPED / "config.json").read_text())
    assert cfg == build_train_config("deepseek_v3")  # what train-tiny writes today
    mc = ModelConfig.from_hf(cfg)
    assert (mc.scoring_func, mc.topk_method, mc.n_group, mc.topk_group) == ("sigmoid", "noaux_tc", 4, 2)
    weights = load_file(str(SHIPPED / "model.safetensors"))
    biases = [weights[f"model.layers.{i}.mlp.gate.e_score_correction_bias"] for i in mc.moe_layer_ids]
    assert all(b.abs().max() > 1e-3 for b in biases)
    summary = json.loads((SHIPPED / "training.json").read_text())
    assert summary["command"].startswith("python -m launch train-tiny --arch deepseek_v3 --out ")


@pytest.mark.slow
def test_reads_better_than_random_weights(trained: TrainableMoE) -> None:
    tok = Tokenizer.from_dir(SHIPPED)
    random_model = TrainableMoE(trained.config)
    random_model.init_weights_(123)
    for kind in ("prose", "code", "tables", "french"):
        prompts = load_workload(kind)[:6]
        _, loss = workload_load(trained, tok, prompts)
        _, random_loss = workload_load(random_model, tok, prompts)
        assert loss < math.log(trained.config.vocab_size) - 1.0, kind  # far below uniform guessing
        assert loss < random_loss - 2.0, kind


@pytest.mark.slow
def test_routing_is_skewed_and_shifts_between_kinds(trained: TrainableMoE) -> None:
    report = routing_report(trained, Tokenizer.from_dir(SHIPPED), max_prompts=8)
    kinds = report["kinds"]
    expert_bal = [b for r in kinds.values() for b in r["expert_balancedness"]]
    assert min(expert_bal) < 0.5  # a hot expert carries > 2x the mean load somewhere
    for r in kinds.values():  # uneven in every layer for every kind
        assert max(r["expert_balancedness"]) < 0.9
    # the hot experts move with the kind of text: some layer moves >= 25% of its tokens
    assert max(max(v) for v in report["shift"].values()) >= 0.25


@pytest.mark.slow
def test_engine_greedy_equals_transformers_uncached(trained: TrainableMoE) -> None:
    transformers = pytest.importorskip("transformers")
    from launch import LLM, SamplingParams
    from tests.unit.test_train_tiny import hf_uncached_greedy

    tok = Tokenizer.from_dir(SHIPPED)
    prompts = [tok.encode(p) for kind in ("prose", "code", "tables", "french") for p in load_workload(kind)[:2]]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    with LLM(str(SHIPPED), dtype="float32") as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    ours = [list(o.outputs[0].token_ids) for o in outs]
    hf = transformers.AutoModelForCausalLM.from_pretrained(SHIPPED, dtype=torch.float32).eval()
    assert ours == [hf_uncached_greedy(hf, p, 12) for p in prompts]
    with torch.no_grad():  # and the training model is the same function of the weights
        ids = torch.tensor([prompts[0] + ours[0]])
        assert (trained(ids) - hf(ids).logits).abs().max() < 1e-4
