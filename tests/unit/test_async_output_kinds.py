"""AsyncLLM.generate's output kinds, as vLLM's: CUMULATIVE every step's whole output, DELTA what each
step added (joined, the cumulative output), FINAL_ONLY the finished output alone (tiny fp32
DeepSeek-V3, one process)."""

from __future__ import annotations

import asyncio

import pytest

from launch.core import RequestOutputKind, SamplingParams
from launch.core.outputs import CompletionOutput, RequestOutput


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from launch.async_llm import AsyncLLM
    from launch.llm import build_runtime_config
    from launch.tiny_checkpoint import make_tiny_checkpoint

    path = make_tiny_checkpoint("deepseek_v3", tmp_path_factory.mktemp("kinds") / "ck")
    llm = AsyncLLM.from_config(build_runtime_config(str(path), dict(dtype="float32", max_model_len=64)))
    yield llm
    llm.shutdown_sync()


def collect(engine, kind: RequestOutputKind, request_id: str) -> list[RequestOutput]:
    params = SamplingParams(temperature=0, max_tokens=7, ignore_eos=True, logprobs=1, prompt_logprobs=1,
                            output_kind=kind)

    async def run() -> list[RequestOutput]:
        return [out async for out in engine.generate([5, 9, 14, 3], params, request_id)]

    return asyncio.run(run())


def test_delta_outputs_join_to_the_cumulative_one(engine) -> None:
    cumulative = collect(engine, RequestOutputKind.CUMULATIVE, "c")
    deltas = collect(engine, RequestOutputKind.DELTA, "d")
    final = cumulative[-1].outputs[0]
    assert len(deltas) == len(cumulative) > 1 and deltas[-1].finished and not deltas[0].finished
    parts = [d.outputs[0] for d in deltas]
    assert [t for p in parts for t in p.token_ids] == final.token_ids
    assert "".join(p.text for p in parts) == final.text
    assert [e for p in parts for e in p.logprobs] == final.logprobs
    assert [r for p in parts for r in p.logprob_ranks] == final.logprob_ranks
    assert parts[-1].cumulative_logprob == final.cumulative_logprob and parts[-1].finish_reason == "length"
    assert deltas[0].prompt_logprobs == cumulative[-1].prompt_logprobs
    assert all(d.prompt_logprobs is None for d in deltas[1:])


def test_final_only_yields_the_finished_output_alone(engine) -> None:
    outs = collect(engine, RequestOutputKind.FINAL_ONLY, "f")
    assert len(outs) == 1 and outs[0].finished
    assert outs[0].outputs[0].token_ids == collect(engine, RequestOutputKind.CUMULATIVE, "c2")[-1].outputs[0].token_ids


def test_delta_of_n_completions_tracks_each_index() -> None:
    from launch.async_llm import delta_output

    def out(texts: list[str], ids: list[list[int]], finished: bool = False) -> RequestOutput:
        return RequestOutput("r", None, [1], [CompletionOutput(i, t, x) for i, (t, x) in enumerate(zip(texts, ids))],
                             finished)

    sent: dict[int, tuple[int, int]] = {}
    a = delta_output(out(["a", ""], [[1], []]), sent)
    b = delta_output(out(["ab", "xy"], [[1, 2], [7, 8]], True), sent)
    assert [(c.text, c.token_ids) for c in a.outputs] == [("a", [1]), ("", [])]
    assert [(c.text, c.token_ids) for c in b.outputs] == [("b", [2]), ("xy", [7, 8])] and b.finished
