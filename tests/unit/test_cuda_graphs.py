"""moe.cuda_graphs: decode steps padded to a bucket on static buffers give each real sequence the
logits, KV entries and slot load of the unpadded eager step. Runs on the CPU with the eager
stand-in backend (the recording itself runs in tests/gpu); the fused CPU ops are off, so both
sides take the op-by-op path a GPU runs."""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch

from moe import cuda_graphs
from moe.config import ModelConfig
from moe.cuda_graphs import DecodeGraphs, EagerBackend, batch_buckets, blocks_bucket
from moe.kv_cache import AttentionMetadata, PagedKVCache
from moe.loader import load_weights
from moe.model import MoEModel

BLOCK = 4
FAMILIES = ["deepseek_v3", "deepseek_v2", "mixtral", "qwen3_moe"]


def test_buckets() -> None:
    assert batch_buckets(1) == [1]
    assert batch_buckets(3) == [1, 2, 3]
    assert batch_buckets(8) == [1, 2, 4, 8]
    assert batch_buckets(20) == [1, 2, 4, 8, 16, 20]
    assert batch_buckets(256)[-3:] == [240, 248, 256] and len(batch_buckets(256)) == 35
    with pytest.raises(ValueError, match="max_batch"):
        batch_buckets(0)
    assert [blocks_bucket(n, 100) for n in (1, 4, 5, 8, 9, 33, 64, 65, 100)] == [4, 4, 8, 8, 16, 64, 64, 100, 100]
    assert blocks_bucket(2, 3) == 3
    with pytest.raises(ValueError, match="exceed"):
        blocks_bucket(9, 8)


def test_fill_lays_out_padding() -> None:
    out = np.full(5 * 4 + 4 * 4, -7, dtype=np.int64)
    cuda_graphs._fill(out, 4, 4, BLOCK, 9, [11, 12], [5, 8], [6, 9], [[3, 4], [5, 6, 7]])
    head, tables = out[:20].reshape(5, 4), out[20:].reshape(4, 4)
    assert head[0].tolist() == [11, 12, 0, 0]  # ids
    assert head[1].tolist() == [5, 8, 0, 0]  # positions
    # slot of position ctx - 1: block table[(c - 1) // S], offset (c - 1) % S; padding: scratch block 9
    assert head[2].tolist() == [4 * BLOCK + 1, 7 * BLOCK + 0, 9 * BLOCK, 9 * BLOCK]
    assert head[3].tolist() == [6, 9, 1, 1]  # context
    assert head[4].tolist() == [1, 1, 0, 0]  # counted in the slot load
    assert tables.tolist() == [[3, 4, 9, 9], [5, 6, 7, 9], [9, 9, 9, 9], [9, 9, 9, 9]]


def _model(path: Path, dtype: torch.dtype, device: str = "cpu") -> MoEModel:
    model = MoEModel(ModelConfig.from_hf(path), dtype=dtype)
    load_weights(model, path, dtype=dtype)
    model.set_fused_ops(False)  # the op-by-op path, as on a GPU
    return model.to(device)


class _Run:
    """Sequences prefilled eagerly, then greedy decode steps either eagerly or on ``graphs``
    (tests/gpu/test_cuda_graphs.py runs it on CUDA)."""

    def __init__(self, model: MoEModel, prompts: list[list[int]], blocks_per_seq: int) -> None:
        self.model, self.seqs = model, [list(p) for p in prompts]
        n = len(prompts)
        device = next(model.parameters()).device
        # block 0 unused, then the sequences' blocks, then the scratch block (last)
        self.cache = PagedKVCache(model.config, 1 + n * blocks_per_seq + 1, BLOCK, model.dtype, device=device)
        self.scratch = self.cache.num_blocks - 1
        self.tables = [[1 + b + n * i for i in range(blocks_per_seq)] for b in range(n)]
        self.graphs: DecodeGraphs | None = None
        meta = AttentionMetadata.build([len(p) for p in prompts], [len(p) for p in prompts], self.tables, BLOCK,
                                       device=device)
        ids = torch.tensor([t for p in prompts for t in p], device=device)
        pos = torch.tensor([i for p in prompts for i in range(len(p))], device=device)
        with torch.inference_mode():
            hidden = model(ids, pos, meta, self.cache)
            self._append(model.compute_logits(hidden[meta.logits_indices()]), range(n))

    def _append(self, logits: torch.Tensor, active: range | list[int], forced: list[int] | None = None) -> None:
        for row, b in enumerate(active):
            self.seqs[b].append(int(logits[row].argmax()) if forced is None else forced[row])

    def decode(self, active: list[int], forced: list[int] | None = None) -> torch.Tensor:
        """One decode step of the sequences ``active``; their logits [B, V]. ``forced``: the tokens to
        append instead of the greedy ones (both sides of a comparison then see the same inputs)."""
        ids = [self.seqs[b][-1] for b in active]
        ctx = [len(self.seqs[b]) for b in active]
        pos = [c - 1 for c in ctx]
        tables = [self.tables[b][: -(-c // BLOCK)] for b, c in zip(active, ctx)]
        with torch.inference_mode():
            logits = self.graphs.run(ids, pos, ctx, tables) if self.graphs is not None else None
            if logits is None:  # not a graph step: eager
                device = self.cache.pools[0].device
                meta = AttentionMetadata.build([1] * len(active), ctx, tables, BLOCK, device=device)
                hidden = self.model(torch.tensor(ids, device=device), torch.tensor(pos, device=device), meta,
                                    self.cache)
                logits = self.model.compute_logits(hidden)
        self._append(logits, active, forced)
        return logits


@pytest.mark.parametrize("family", FAMILIES)
def test_graph_steps_equal_eager_steps(hf_checkpoints: dict[str, Path], family: str) -> None:
    """Shrinking batches (3 -> 2 -> 1 rows: buckets 4, 2, 1) over contexts that cross a block-bucket
    edge: the same logits and greedy tokens as eager steps, the same KV entries in every real block,
    and the slot load of the real rows only."""
    model = _model(hf_checkpoints[family], torch.float32)
    prompts = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18], [10, 11, 12], [13, 14, 15, 16, 17]]
    eager = _Run(model, prompts, blocks_per_seq=8)
    graphed = _Run(copy.deepcopy(model), prompts, blocks_per_seq=8)
    graphed.graphs = DecodeGraphs(graphed.model, graphed.cache, scratch_block=graphed.scratch, max_batch=8,
                                  max_blocks=8, backend=EagerBackend(), capture_after=1)
    for run in (eager, graphed):
        for layer in run.model.moe_layers():
            layer.slot_load.zero_()
    schedule = [[0, 1, 2]] * 4 + [[1, 2]] * 3 + [[2]] * 2
    for k, active in enumerate(schedule):
        a, b = eager.decode(active), graphed.decode(active)
        assert b.shape == a.shape == (len(active), model.config.vocab_size), k
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
        assert eager.seqs == graphed.seqs, k
    # the first sequence crossed from 4 to 8 blocks (context 15 -> 19 tokens): two block buckets
    assert sorted(graphed.graphs.graphs) == [(1, 4), (2, 4), (4, 4), (4, 8)]
    assert graphed.graphs.captures == 4
    for pa, pb in zip(eager.cache.pools, graphed.cache.pools):
        torch.testing.assert_close(pb[: graphed.scratch], pa[: graphed.scratch], rtol=1e-5, atol=1e-5)
        assert pb[graphed.scratch].abs().sum() > 0  # the padded rows wrote into the scratch block only
    for la, lb in zip(eager.model.moe_layers(), graphed.model.moe_layers()):
        assert torch.equal(la.slot_load, lb.slot_load) and int(la.slot_load.sum()) > 0
        assert la.count_rows is None and lb.count_rows is None  # reset after every forward


def test_graph_steps_in_bfloat16_pick_the_eager_tokens(hf_checkpoints: dict[str, Path]) -> None:
    model = _model(hf_checkpoints["deepseek_v3"], torch.bfloat16)
    prompts = [[5, 6, 7, 8, 9], [10, 11, 12]]
    eager, graphed = _Run(model, prompts, 4), _Run(copy.deepcopy(model), prompts, 4)
    graphed.graphs = DecodeGraphs(graphed.model, graphed.cache, scratch_block=graphed.scratch, max_batch=4,
                                  max_blocks=4, backend=EagerBackend(), capture_after=1)
    for _ in range(5):
        a, b = eager.decode([0, 1]), graphed.decode([0, 1])
        assert b.dtype == torch.float32
        torch.testing.assert_close(b, a, rtol=2e-2, atol=2e-2)
    assert eager.seqs == graphed.seqs


def test_only_models_whose_experts_count_on_the_device_are_capturable(hf_checkpoints: dict[str, Path]) -> None:
    """On a CPU the experts' row counts are read back (no library grouped GEMM serves them here)."""
    model = _model(hf_checkpoints["deepseek_v3"], torch.bfloat16)
    why = cuda_graphs.not_capturable(model)
    assert why is not None and "bfloat16 on cpu" in why and "grouped GEMM" in why


def test_steps_a_graph_does_not_serve(hf_checkpoints: dict[str, Path]) -> None:
    model = _model(hf_checkpoints["mixtral"], torch.float32)
    run = _Run(model, [[5, 6, 7]], 2)
    graphs = DecodeGraphs(model, run.cache, scratch_block=run.scratch, max_batch=2, max_blocks=2,
                          backend=EagerBackend(), capture_after=1)
    assert graphs.bucket([3, 4, 5]) is None  # more sequences than the largest bucket
    assert graphs.bucket([9]) is None  # longer than max_blocks blocks
    assert graphs.bucket([]) is None
    assert graphs.bucket([8, 3]) == (2, 2)
    with pytest.raises(ValueError, match="scratch_block"):
        DecodeGraphs(model, run.cache, scratch_block=run.cache.num_blocks, max_batch=2, max_blocks=2)


def test_graphs_are_dropped_when_the_model_tensors_move(hf_checkpoints: dict[str, Path]) -> None:
    model = _model(hf_checkpoints["deepseek_v3"], torch.float32)
    run = _Run(model, [[5, 6, 7], [8, 9]], 4)
    run.graphs = DecodeGraphs(model, run.cache, scratch_block=run.scratch, max_batch=2, max_blocks=4,
                              backend=EagerBackend(), capture_after=1)
    run.decode([0, 1])
    run.decode([0, 1])
    assert run.graphs.captures == 1
    layer = next(model.moe_layers())
    layer.set_placement(layer.phy2log.clone(), 1, 0)  # new placement buffers: new addresses
    run.decode([0, 1])
    assert run.graphs.captures == 2 and len(run.graphs.graphs) == 1
    layer.use_fused_ffn = False  # an announced change that moves nothing: graphs kept
    run.decode([0, 1])
    assert run.graphs.captures == 2


def test_a_bucket_is_recorded_on_its_eighth_step(hf_checkpoints: dict[str, Path]) -> None:
    """Steps of a bucket run eagerly (the same values) until the bucket has been asked for
    ``CAPTURE_AFTER`` times: a batch size seen for a step or two costs no recording."""
    model = _model(hf_checkpoints["mixtral"], torch.float32)
    run = _Run(model, [[5, 6, 7], [8, 9]], 4)
    twin = _Run(copy.deepcopy(model), [[5, 6, 7], [8, 9]], 4)
    run.graphs = DecodeGraphs(model, run.cache, scratch_block=run.scratch, max_batch=2, max_blocks=4,
                              backend=EagerBackend())
    assert run.graphs.capture_after == cuda_graphs.CAPTURE_AFTER == 8
    for step in range(10):
        torch.testing.assert_close(run.decode([0, 1]), twin.decode([0, 1]), rtol=1e-5, atol=1e-5)
        assert run.graphs.captures == (1 if step >= 7 else 0), step
    run.decode([0])  # another bucket: its first step, eager
    assert run.graphs.captures == 1 and sorted(run.graphs.graphs) == [(2, 4)]
    assert run.graphs.capture_seconds > 0


class _Refusing(EagerBackend):
    def capture(self, fn):  # type: ignore[no-untyped-def]
        raise RuntimeError("operation not permitted when stream is capturing\nmore")


def test_a_refused_capture_falls_back_to_eager_for_good(hf_checkpoints: dict[str, Path],
                                                        caplog: pytest.LogCaptureFixture) -> None:
    model = _model(hf_checkpoints["qwen3_moe"], torch.float32)
    run = _Run(model, [[5, 6, 7]], 2)
    graphs = DecodeGraphs(model, run.cache, scratch_block=run.scratch, max_batch=2, max_blocks=2,
                          backend=_Refusing(), capture_after=1)
    with torch.inference_mode():
        assert graphs.run([3], [3], [4], [[1]]) is None
    assert graphs.disabled == "RuntimeError: operation not permitted when stream is capturing"
    assert "decoding without graphs" in caplog.text
    assert graphs.bucket([4]) is None and not graphs.graphs


def test_a_worker_says_why_it_decodes_without_graphs(tiny_ckpt: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Graphs asked for where they cannot run: the worker decodes eagerly and logs the reason once;
    each refusal names its cause, and a single CUDA rank with dropless bf16 experts has none."""
    from types import SimpleNamespace

    from launch.worker import Worker, WorkerSpec
    from moe.capacity import CapacityConfig

    worker = Worker(WorkerSpec(str(tiny_ckpt), dtype="float32", num_kv_blocks=16, cudagraph_max_batch=8), 0)
    with caplog.at_level("INFO", logger="launch.worker"):
        worker.setup()
    try:
        assert worker.decode_graphs is None and worker.kv_cache.num_blocks == 16
        assert caplog.text.count("decoding without CUDA graphs: the model runs on cpu") == 1
    finally:
        worker.shutdown()
    caplog.clear()
    quiet = Worker(WorkerSpec(str(tiny_ckpt), dtype="float32", num_kv_blocks=16), 0)  # not asked for: no line
    with caplog.at_level("INFO", logger="launch.worker"):
        quiet.setup()
    quiet.shutdown()
    assert "CUDA graphs" not in caplog.text

    base = WorkerSpec(str(tiny_ckpt), cudagraph_max_batch=8)

    def refused(spec: WorkerSpec = base, ep: int = 1, window: int | None = None) -> str | None:
        fake = SimpleNamespace(spec=spec, device=torch.device("cuda"), layout=SimpleNamespace(ep_size=ep),
                               config=SimpleNamespace(sliding_window=window))
        return Worker._graphs_refused(fake)  # type: ignore[arg-type]

    assert refused() is None
    assert "2 ranks (tp 2, dp 1, ep 1)" in refused(dataclasses.replace(base, tp=2))
    assert "ep 2" in refused(ep=2)
    assert "capacity-factor" in refused(dataclasses.replace(base, capacity=CapacityConfig(capacity_factor=1.25)))
    assert refused(window=4096) == "sliding-window attention"
    assert refused(dataclasses.replace(base, quantization="int8")) == "int8 experts"


def test_a_graph_step_hands_the_sampler_only_its_sampled_rows(tiny_ckpt: Path) -> None:
    """A decode-shaped step whose row 0 is a one-token prefill chunk short of its prompt's end:
    ``Worker._graph_logits`` returns the replay's logits of the sampling rows only, [S - 1, V]."""
    from launch import SamplingParams
    from launch.core.batch import BatchSpec, ScheduledSequence
    from launch.worker import Worker, WorkerSpec

    worker = Worker(WorkerSpec(str(tiny_ckpt), dtype="float32", num_kv_blocks=16), 0)
    worker.setup()
    try:
        worker.decode_graphs = DecodeGraphs(worker.model, worker.kv_cache, scratch_block=15, max_batch=4,
                                            max_blocks=2, backend=EagerBackend(), capture_after=1)
        params = SamplingParams(temperature=0.0)
        seqs = tuple(ScheduledSequence(f"r{i}", i, i, (3 + i,), (4,), 4, (1 + i,), i > 0, params, 0)
                     for i in range(3))
        batch = BatchSpec(dp_rank=0, block_size=worker.spec.block_size, seqs=seqs)
        with torch.inference_mode():
            whole = worker.decode_graphs.run(batch.input_ids, batch.positions, batch.context_lens,
                                             batch.block_tables)
            assert whole is not None
            whole = whole.clone()
            picked = worker._graph_logits(batch)
        assert picked is not None and picked.shape == (2, worker.config.vocab_size)
        torch.testing.assert_close(picked, whole[1:])
        every = BatchSpec(dp_rank=0, block_size=worker.spec.block_size,
                          seqs=tuple(dataclasses.replace(s, do_sample=True) for s in seqs))
        with torch.inference_mode():
            assert worker._graph_logits(every).shape == (3, worker.config.vocab_size)
        prefill = BatchSpec(dp_rank=0, block_size=worker.spec.block_size,
                            seqs=(dataclasses.replace(seqs[1], token_ids=(3, 4), positions=(3, 4)),))
        assert worker._graph_logits(prefill) is None  # not a decode step: eager
    finally:
        worker.shutdown()
