"""Every engine path gives transformers' greedy tokens: batching, chunked prefill, prefix
caching and preemption (single process; the Ray layouts are in tests/ray)."""

from __future__ import annotations

import pytest

from launch import LLM, SamplingParams
from tests.oracles import NEW_TOKENS, hf_greedy, make_prompts, run


@pytest.mark.parametrize("case", ["deepseek_v2", "deepseek_v3", "mixtral", "qwen3_moe"])
def test_batched_greedy_matches_transformers(hf_checkpoints, case):
    path = hf_checkpoints[case]
    prompts = make_prompts(1, 6, 96)
    ours = run(path, prompts)
    assert ours == hf_greedy(path, prompts, NEW_TOKENS)


@pytest.mark.parametrize("case", ["deepseek_v3", "qwen3_moe"])
def test_chunked_prefill_prefix_caching_and_preemption(hf_checkpoints, case):
    """16 concurrent requests sharing prefixes, 32-token steps, 4-token blocks: identical to
    one request at a time, to an unconstrained run, to a run whose pool forces preemption,
    and to transformers."""
    path = hf_checkpoints[case]
    prompts = make_prompts(2, 16, 96, shared_prefix=13)
    oracle = hf_greedy(path, prompts, NEW_TOKENS)
    chunked = run(path, prompts, max_num_batched_tokens=32, block_size=4, enable_prefix_caching=True,
                  enable_chunked_prefill=True, max_model_len=128)
    assert chunked == oracle
    one_by_one = [run(path, [p], block_size=4)[0] for p in prompts[:3]]
    assert one_by_one == oracle[:3]
    # 20 blocks of 4 tokens hold ~1.5 sequences: requests must be preempted and resumed.
    tight = run(path, prompts, max_num_batched_tokens=32, block_size=4, num_kv_blocks=20, max_model_len=80)
    assert tight == oracle


def test_preemption_actually_happens(hf_checkpoints):
    path = hf_checkpoints["deepseek_v3"]
    prompts = make_prompts(3, 8, 96)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    with LLM(str(path), dtype="float32", block_size=4, num_kv_blocks=16, max_model_len=64,
             max_num_batched_tokens=64) as llm:
        llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        assert llm.engine.scheduler.num_preemptions > 0
        assert llm.engine.scheduler.stats().kv_cache_usage[0] == 0.0 or not llm.engine.scheduler.config.dp_size


def test_text_prompts_and_stop(tmp_path):
    from launch.tiny_checkpoint import make_tiny_checkpoint

    path = make_tiny_checkpoint("deepseek_v3", tmp_path / "ck")
    with LLM(str(path), dtype="bfloat16") as llm:
        first = llm.generate("The expert", SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))[0]
        text = first.outputs[0].text
        assert len(first.outputs[0].token_ids) == 12 and text
        # a 3-character piece of the second half that is not all white space (the stop check
        # strips nothing, but a blank piece would make a weak test)
        stop = next(text[i:i + 3] for i in range(len(text) // 2, len(text)) if text[i:i + 3].strip())
        again = llm.generate("The expert", SamplingParams(temperature=0.0, max_tokens=12, stop=[stop]))[0]
        assert again.outputs[0].finish_reason == "stop"
        assert again.outputs[0].text == text[:text.index(stop)]
        seeded = [llm.generate("The expert", SamplingParams(temperature=1.0, seed=7, max_tokens=8))[0]
                  for _ in range(2)]
        assert seeded[0].outputs[0].token_ids == seeded[1].outputs[0].token_ids


def test_bad_requests_name_the_problem(hf_checkpoints):
    with LLM(str(hf_checkpoints["mixtral"]), dtype="float32", max_model_len=64) as llm:
        with pytest.raises(ValueError, match="outside the vocabulary"):
            llm.generate({"prompt_token_ids": [5, 96]})
        with pytest.raises(ValueError, match="max_model_len"):
            llm.generate({"prompt_token_ids": [5] * 65})
        ok = llm.generate({"prompt_token_ids": [5, 6]}, SamplingParams(max_tokens=3, ignore_eos=True))
        assert len(ok[0].outputs[0].token_ids) == 3
    with pytest.raises(TypeError, match="unexpected keyword argument 'bogus'"):
        LLM(str(hf_checkpoints["mixtral"]), bogus=1)


def test_fp8_kv_cache_and_capacity_factor(hf_checkpoints):
    """fp8 KV storage keeps greedy decoding on track; a capacity factor drops (and counts)
    assignments, while a factor too large to bind changes nothing."""
    path = hf_checkpoints["deepseek_v3"]
    prompts = make_prompts(4, 6, 96)
    exact = run(path, prompts, n=6)
    fp8 = run(path, prompts, n=6, kv_cache_dtype="fp8")
    # e4m3 KV (3 mantissa bits) may flip a late near-tie, never an early token: every sequence
    # agrees on its first 4 tokens and most agree throughout
    assert all(a[:4] == b[:4] for a, b in zip(exact, fp8))
    assert sum(a == b for a, b in zip(exact, fp8)) >= len(prompts) // 2
    assert run(path, prompts, n=6, capacity_factor=100.0) == exact
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    with LLM(str(path), dtype="float32", capacity_factor=0.5) as llm:
        llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        assert llm.engine.counters.tokens_dropped > 0
