"""Review: a CUDA-graph decode step (one token per row) in which a row does not sample.

The scheduler gives a prefill a one-token chunk when one token of budget is left (chunked
prefill, budget <= max_num_seqs): every row then has one token, so the step qualifies for the
decode graphs, but that row's chunk is mid-prompt and samples nothing. The graph gives logits for
all B rows; the sampler (and the penalised rows' sequence ids) take the sampled rows only."""

from __future__ import annotations

import pytest

from launch.core import BatchSpec, SamplingParams, ScheduledSequence
from launch.core.batch import HistoryChunk
from launch.worker import Worker, WorkerSpec


class AllRowsGraphs:
    """Stands in for ``moe.cuda_graphs.DecodeGraphs`` on CPU: the logits of every row of the step
    (what the replay's lm_head gives), from the worker's eager forward."""

    def __init__(self, worker: Worker) -> None:
        self.worker, self.batch, self.calls = worker, None, 0

    def run(self, input_ids, positions, context_lens, block_tables):
        self.calls += 1
        rows = list(range(len(input_ids)))
        return self.worker._eager_logits(self.batch, rows)[0]


@pytest.mark.slow
def test_graph_step_with_a_row_that_does_not_sample(tiny_ckpt):
    worker = Worker(WorkerSpec(str(tiny_ckpt), dtype="float32", num_kv_blocks=16), 0)
    worker.setup()
    try:
        greedy = SamplingParams(temperature=0.0)
        penalised = SamplingParams(temperature=0.0, repetition_penalty=1.5)
        prompt_a, prompt_b = (3, 17, 29, 4, 8), (11, 12, 13, 14)
        prefill = BatchSpec(0, 16, (
            ScheduledSequence("a", 0, 0, prompt_a, tuple(range(5)), 0, (1,), True, penalised, 0),
            ScheduledSequence("b", 1, 0, prompt_b[:2], (0, 1), 0, (2,), False, greedy, 0),
        ), history=(HistoryChunk(0, 0, 5),))
        (token,) = worker.execute(prefill, False).sampled.token_ids
        # a decode row of "a" (penalised) and a one-token, mid-prompt chunk of "b": all rows one token
        step = BatchSpec(0, 16, (
            ScheduledSequence("a", 0, 0, (token,), (5,), 5, (1,), True, penalised, 1),
            ScheduledSequence("b", 1, 0, prompt_b[2:3], (2,), 2, (2,), False, greedy, 0),
        ), history=(HistoryChunk(0, 0, 5),))
        eager = worker.execute(step, False).sampled.token_ids
        worker.token_history.release([0])  # replay the same step on the stand-in graphs
        worker.token_history.record(prefill.history, prefill.input_ids, prefill.query_lens, prefill.context_lens)
        graphs = worker.decode_graphs = AllRowsGraphs(worker)
        graphs.batch = step
        assert worker.execute(step, False).sampled.token_ids == eager
        assert graphs.calls == 1
    finally:
        worker.decode_graphs = None
        worker.shutdown()
