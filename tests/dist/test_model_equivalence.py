"""Whole-model logits on 4 gloo ranks (EP over DP-attention ranks, and TP x DP) equal the
single-process model on the same sequences, through prefill and teacher-forced decode steps.

Each DP rank serves its own sequences (a DP rank may have none: it still runs every step,
entering every collective). The oracle runs each DP rank's sequences through one
unsharded model. With a global capacity the oracle runs all DP ranks' sequences as one
batch, in DP order, through a single-rank capped dispatcher: the same decisions as the
EP group's source-rank-then-position order.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from moe.config import ModelConfig
from moe.kv_cache import AttentionMetadata, PagedKVCache
from moe.loader import load_weights
from moe.model import MoEModel
from moe.tiny import write_tiny_checkpoint
from moe.capacity import CapacityConfig
from parallel.dispatch import CappedLocalDispatcher, build_dispatcher
from parallel.groups import build_process_groups
from parallel.layout import Layout
from tests.dist.conftest import COLLECTIVE_TIMEOUT_S, run_ranks

BLOCK = 4
STEPS = 3  # one prefill, two decodes
ATOL = 1e-4  # fp32; TP and EP change summation order only


@dataclass(frozen=True)
class Seq:
    prompt: tuple[int, ...]
    decode: tuple[int, ...]  # teacher-forced tokens, one per decode step
    blocks: tuple[int, ...]


@dataclass(frozen=True)
class ModelCase:
    name: str
    arch: str
    tp: int
    dp: int
    backend: str
    prompt_lens: tuple[tuple[int, ...], ...]  # per DP rank
    phy2log: tuple[int, ...] | None = None  # None: identity, one slot per expert
    global_cf: float = 0.0
    local_cf: float = 0.0
    seed: int = 0


CASES = [
    ModelCase("ep4_a2a_mla", "deepseek_v3", 1, 4, "alltoall", ((5, 3), (7,), (), (2, 4))),
    ModelCase("ep4_a2a_gqa_replicas", "mixtral", 1, 4, "alltoall", ((4,), (6, 2), (3,), (5,)),
              phy2log=(0, 1, 2, 3, 4, 5, 6, 7, 0, 3, 5, 7), seed=1),
    ModelCase("ep4_ag_mla", "deepseek_v3", 1, 4, "allgather", ((3,), (), (6,), (1, 2)), seed=2),
    ModelCase("tp2dp2_a2a_mla", "deepseek_v3", 2, 2, "alltoall", ((5, 2), (6,)), seed=3),
    ModelCase("tp2dp2_a2a_gqa", "mixtral", 2, 2, "alltoall", ((4, 3), ()), seed=4),
    ModelCase("tp2dp2_a2a_mla_local_capacity", "deepseek_v3", 2, 2, "alltoall", ((7, 5), (6,)),
              local_cf=0.5, seed=5),
    ModelCase("ep4_a2a_mla_global_capacity", "deepseek_v3", 1, 4, "alltoall", ((6,), (4, 3), (), (5,)),
              global_cf=0.5, seed=6),
]


def sequences(case: ModelCase, vocab: int) -> list[list[Seq]]:
    """Per DP rank its sequences, with block ids unique across all ranks."""
    gen = torch.Generator().manual_seed(case.seed)
    per_seq_blocks = -(-(max(max(lens, default=1) for lens in case.prompt_lens) + STEPS) // BLOCK)
    out, next_block = [], 1
    for lens in case.prompt_lens:
        seqs = []
        for n in lens:
            toks = torch.randint(2, vocab, (n + STEPS - 1,), generator=gen).tolist()
            blocks = tuple(range(next_block, next_block + per_seq_blocks))
            next_block += per_seq_blocks
            seqs.append(Seq(tuple(toks[:n]), tuple(toks[n:]), blocks))
        out.append(seqs)
    return out


def run_steps(model: MoEModel, seqs: list[Seq], num_blocks: int, tp_size: int = 1) -> list[torch.Tensor]:
    """Prefill every sequence, then feed its decode tokens. Returns logits [B, V] per step."""
    cache = PagedKVCache(model.config, num_blocks, BLOCK, torch.float32, tp_size=tp_size)
    logits = []
    for step in range(STEPS):
        if step == 0:
            qlens = [len(s.prompt) for s in seqs]
            ids = [t for s in seqs for t in s.prompt]
            pos = [p for s in seqs for p in range(len(s.prompt))]
        else:
            qlens = [1] * len(seqs)
            ids = [s.decode[step - 1] for s in seqs]
            pos = [len(s.prompt) + step - 1 for s in seqs]
        ctx = [len(s.prompt) + step for s in seqs]
        meta = AttentionMetadata.build(qlens, ctx, [list(s.blocks) for s in seqs], BLOCK)
        with torch.no_grad():
            hidden = model(torch.tensor(ids, dtype=torch.int64), torch.tensor(pos, dtype=torch.int64), meta, cache)
            logits.append(model.compute_logits(hidden[meta.logits_indices()]))
    return logits


def _num_blocks(all_seqs: list[list[Seq]]) -> int:
    return 1 + max((b for seqs in all_seqs for s in seqs for b in s.blocks), default=0)


def _rank_model(case: ModelCase, path: Path, rank: int, groups_cache: dict) -> tuple[MoEModel, int, int]:
    layout = Layout(tp=case.tp, dp=case.dp)
    if layout not in groups_cache:  # same order on every rank: new_group is collective
        groups_cache[layout] = build_process_groups(layout, rank, timeout=COLLECTIVE_TIMEOUT_S)
    groups = groups_cache[layout]
    config = ModelConfig.from_hf(path)
    phy2log = case.phy2log or tuple(range(config.num_experts))
    local = [phy2log[p] for p in layout.local_slots(rank, len(phy2log))]
    cap = CapacityConfig(case.global_cf, scope="global") if case.global_cf > 0 else None
    dispatcher = build_dispatcher(case.backend, groups, layout, global_capacity=cap)
    model = MoEModel(config, dtype=torch.float32, local_slots=local, dispatcher=dispatcher,
                     tp_group=groups.tp, tp_rank=groups.coords.tp_rank, tp_size=case.tp,
                     capacity=CapacityConfig(case.local_cf))
    for layer in model.moe_layers():
        layer.set_placement(torch.tensor(phy2log), layout.ep_size, groups.coords.ep_rank)
    load_weights(model, path, dtype=torch.float32)
    model.shard_for_tp()
    return model, groups.coords.dp_rank, groups.coords.tp_rank


def _run_cases(rank: int, world_size: int, paths: dict[str, str]) -> dict:
    groups_cache: dict = {}
    results = {}
    for case in CASES:
        model, dp_rank, tp_rank = _rank_model(case, Path(paths[case.arch]), rank, groups_cache)
        all_seqs = sequences(case, model.config.vocab_size)
        logits = run_steps(model, all_seqs[dp_rank], _num_blocks(all_seqs), case.tp)
        dropped = sum(layer.counters["dropped"] for layer in model.moe_layers())
        stats = getattr(model.moe_layers().__next__().dispatcher, "capacity_stats", {})
        results[case.name] = {"dp_rank": dp_rank, "logits": logits, "local_dropped": dropped,
                              "global_dropped": sum(s.dropped for s in stats.values())}
    return results


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("ckpt")
    return {arch: str(write_tiny_checkpoint(arch, root / arch)) for arch in {c.arch for c in CASES}}


@pytest.fixture(scope="module")
def dist_results(checkpoints: dict[str, str]) -> list[dict]:
    return run_ranks(_run_cases, 4, checkpoints, timeout_s=240.0)


def _oracle(case: ModelCase, path: str) -> list[list[torch.Tensor]]:
    """Logits per DP rank per step from one unsharded process."""
    config = ModelConfig.from_hf(path)
    global_cap = CapacityConfig(case.global_cf, scope="global")
    dispatcher = CappedLocalDispatcher(global_cap) if case.global_cf > 0 else None
    model = MoEModel(config, dtype=torch.float32, dispatcher=dispatcher, capacity=CapacityConfig(case.local_cf))
    load_weights(model, path, dtype=torch.float32)
    all_seqs = sequences(case, config.vocab_size)
    num_blocks = _num_blocks(all_seqs)
    if case.global_cf <= 0:
        return [run_steps(model, seqs, num_blocks) for seqs in all_seqs]
    joint = run_steps(model, [s for seqs in all_seqs for s in seqs], num_blocks)
    sizes = [len(seqs) for seqs in all_seqs]
    return [[step.split(sizes)[d] for step in joint] for d in range(len(all_seqs))]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_logits_match_single_process(case: ModelCase, dist_results: list[dict], checkpoints: dict) -> None:
    want = _oracle(case, checkpoints[case.arch])
    vocab = ModelConfig.from_hf(checkpoints[case.arch]).vocab_size
    for rank, res in enumerate(dist_results):
        got = res[case.name]
        expected = want[got["dp_rank"]]
        assert len(got["logits"]) == STEPS
        for step, (g, w) in enumerate(zip(got["logits"], expected)):
            assert g.shape == (len(case.prompt_lens[got["dp_rank"]]), vocab)
            torch.testing.assert_close(g, w, atol=ATOL, rtol=1e-4, msg=lambda m, r=rank, s=step: f"rank {r} step {s}: {m}")
    if case.local_cf > 0:
        assert any(r[case.name]["local_dropped"] > 0 for r in dist_results)
    if case.global_cf > 0:
        assert sum(r[case.name]["global_dropped"] for r in dist_results) > 0
