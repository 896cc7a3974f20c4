"""The worker's per-step routing counters: every MoE layer's slot loads, read and reset each step,
from buffers it keeps between steps while no module announces a change (a new placement does)."""

from __future__ import annotations

import pytest
import torch

from launch.core import BatchSpec, SamplingParams, ScheduledSequence
from launch.worker import Worker, WorkerSpec


def _decode_batch(tokens: list[int], context: int) -> BatchSpec:
    params = SamplingParams(temperature=0.0)
    rows = tuple(ScheduledSequence(f"r{i}", i, 0, (t,), (context - 1,), context - 1, (i,), True, params, 1)
                 for i, t in enumerate(tokens))
    return BatchSpec(0, 16, rows)


@pytest.fixture()
def worker(tiny_ckpt):
    w = Worker(WorkerSpec(str(tiny_ckpt), dtype="float32", num_kv_blocks=16), 0)
    w.setup()
    yield w
    w.shutdown()


def test_slot_loads_follow_a_new_placement(worker):
    layers = list(worker.model.moe_layers())
    num_layers, top_k, experts = len(layers), worker.config.num_experts_per_tok, worker.config.num_experts
    batch = _decode_batch([5, 9, 13], 4)
    for _ in range(2):  # the second step reads the buffers kept from the first
        result = worker.execute(batch, True)
        assert result.slot_load.shape == (num_layers, experts) and result.slot_load.dtype == torch.int64
        assert result.slot_load.sum(1).tolist() == [3 * top_k] * num_layers  # this step's only
        assert result.capacity == [(0, 0)] * num_layers
    # a new placement (slots permuted) gives every layer new slot_load buffers, which the next step
    # reads: not the old ones (filled here with what would show)
    old = [layer.slot_load for layer in layers]
    for layer in layers:
        layer.set_placement(torch.arange(experts).flip(0), 1, 0)
    for buf in old:
        buf.fill_(1000)
    result = worker.execute(batch, True)
    assert result.slot_load.shape == (num_layers, experts)
    assert result.slot_load.sum(1).tolist() == [3 * top_k] * num_layers
    assert all(int(layer.slot_load.sum()) == 0 for layer in layers)  # reset after the read
    # no load asked for: none reported, the counters still reset
    assert worker.execute(batch, False).slot_load is None
    assert all(int(layer.slot_load.sum()) == 0 for layer in layers)


def test_a_move_of_the_model_is_announced(worker):
    """``.to()`` replaces buffers in their dicts, around ``__setattr__``; it still announces."""
    from moe import plan_watch

    before = plan_watch.epoch()
    worker.model.to(torch.float32)
    assert plan_watch.epoch() > before
