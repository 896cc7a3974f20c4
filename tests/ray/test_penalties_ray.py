"""Penalties, min_tokens and prompt_logprobs on Ray actors (DP 2 x EP 2, both step transports) give
what one in-process rank gives: tokens (a seeded random row among them) and prompt logprobs."""

from __future__ import annotations

import pytest

from launch import LLM, SamplingParams
from tests.conftest import write_hf_checkpoint
from tests.oracles import make_prompts

PARAMS = [
    SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, repetition_penalty=1.5, prompt_logprobs=1),
    SamplingParams(temperature=0.0, max_tokens=10, stop_token_ids=[36], min_tokens=4, frequency_penalty=0.7),
    SamplingParams(temperature=0.9, seed=4, max_tokens=10, ignore_eos=True, presence_penalty=1.0, top_k=10),
    SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True),
    SamplingParams(temperature=0.0, max_tokens=6, prompt_logprobs=0, repetition_penalty=0.8),
]


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    path = write_hf_checkpoint("deepseek_v3", tmp_path_factory.mktemp("penalties_ray") / "dsv3", seed=1)
    prompts = make_prompts(7, len(PARAMS), 96, shared_prefix=9)
    return path, prompts, run(path, prompts)


def run(path, prompts, **layout) -> list[tuple[list[int], list | None]]:
    with LLM(str(path), dtype="float32", block_size=4, max_num_batched_tokens=16, **layout) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], PARAMS)
    return [(o.outputs[0].token_ids, o.prompt_logprobs) for o in outs]


@pytest.mark.parametrize("transport", ["socket", "ray"])
def test_ray_ranks_match_one_process(ray_local, single, transport):
    path, prompts, want = single
    got = run(path, prompts, data_parallel_size=2, enable_expert_parallel=True, step_transport=transport)
    assert [tokens for tokens, _ in got] == [tokens for tokens, _ in want]
    for (_, scores), (_, ref) in zip(got, want):
        if ref is None:
            assert scores is None
            continue
        assert scores[0] is None and len(scores) == len(ref)
        for entry, ref_entry in zip(scores[1:], ref[1:]):
            assert list(entry) == list(ref_entry)
            assert list(entry.values()) == pytest.approx(list(ref_entry.values()), abs=1e-4)
