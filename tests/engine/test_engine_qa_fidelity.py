"""QA of the offline engine as a vLLM user drives it: logprobs against the model's own logits,
stop tokens with include_stop_str_in_output, stop_token_ids outside the vocabulary, n > 1 sharing
its prompt's blocks, aborts that free every block, the max_model_len boundary (tiny fp32
checkpoint, one process)."""

from __future__ import annotations

import pytest
import torch

from launch import LLM, SamplingParams
from launch.tiny_checkpoint import make_tiny_checkpoint

PROMPT = list(range(2, 19))  # 17 tokens: 4 full blocks of 4


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_checkpoint("deepseek_v3", tmp_path_factory.mktemp("qa") / "dsv3")


@pytest.fixture(scope="module")
def llm(tiny):
    with LLM(str(tiny), dtype="float32", max_model_len=32, block_size=4, num_kv_blocks=64,
             max_num_batched_tokens=8) as llm:
        yield llm


def test_logprobs_are_the_raw_log_softmax_of_the_model_logits(tiny, llm):
    """vLLM's default logprobs: log_softmax of the unprocessed logits, whatever the temperature;
    the sampled token first, then the top-n (oracle: transformers on the same checkpoint)."""
    import transformers

    out = llm.generate({"prompt_token_ids": PROMPT},
                       SamplingParams(temperature=0.7, top_k=20, seed=3, max_tokens=4, logprobs=3))[0].outputs[0]
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32)
    with torch.no_grad():
        ref = model(torch.tensor([PROMPT + out.token_ids])).logits[0].log_softmax(-1)  # [T, V]
    total = 0.0
    for i, (token, entry) in enumerate(zip(out.token_ids, out.logprobs)):
        row = ref[len(PROMPT) - 1 + i]
        assert next(iter(entry)) == token and entry[token] == pytest.approx(row[token].item(), abs=1e-4)
        top = row.topk(3)
        for t, lp in zip(top.indices.tolist(), top.values.tolist()):
            assert entry[t] == pytest.approx(lp, abs=1e-4)
        total += entry[token]
    assert out.cumulative_logprob == pytest.approx(total)


def test_stop_token_text_is_kept_with_include_stop_str_in_output(llm):
    greedy = llm.generate({"prompt_token_ids": PROMPT}, SamplingParams(temperature=0, max_tokens=6))[0].outputs[0]
    stop_id = greedy.token_ids[3]
    decode = llm.get_tokenizer().decode
    for include, upto in ((False, 3), (True, 4)):
        out = llm.generate({"prompt_token_ids": PROMPT}, SamplingParams(
            temperature=0, max_tokens=6, stop_token_ids=[stop_id], include_stop_str_in_output=include))[0].outputs[0]
        assert out.token_ids == greedy.token_ids[:4] and out.stop_reason == stop_id
        assert out.text == decode(greedy.token_ids[:upto])


def test_stop_token_ids_outside_the_vocabulary_are_refused(llm):
    """vLLM refuses them ("stop_token_ids contain out-of-vocab token ids"); they could never match."""
    vocab = llm.engine.model_config.vocab_size
    with pytest.raises(ValueError, match=rf"^prompt 0: stop_token_ids: token id {vocab} is outside the vocabulary"):
        llm.generate({"prompt_token_ids": PROMPT}, SamplingParams(stop_token_ids=[5, vocab]))
    with pytest.raises(ValueError, match="stop_token_ids"):
        llm.engine.add_request("bad", PROMPT, SamplingParams(stop_token_ids=[vocab + 7]))
    assert not llm.engine.has_unfinished_requests()


def test_n_completions_share_the_prompt_and_match_their_seeds_alone(tiny):
    """n=3 seeded: each completion's tokens equal a lone request with seed + index, and the
    prompt is computed once (the other two hit its 4 cached blocks: 2 x 16 tokens)."""
    params = SamplingParams(temperature=1.0, seed=11, n=3, max_tokens=6, ignore_eos=True)
    with LLM(str(tiny), dtype="float32", max_model_len=32, block_size=4, num_kv_blocks=64) as llm:
        out = llm.generate({"prompt_token_ids": PROMPT}, params)[0]
        assert llm.engine.scheduler.stats().prefix_cache_hits == 2 * 16
        alone = [llm.generate({"prompt_token_ids": PROMPT}, SamplingParams(
            temperature=1.0, seed=11 + i, max_tokens=6, ignore_eos=True))[0].outputs[0].token_ids for i in range(3)]
    assert [c.token_ids for c in out.outputs] == alone
    assert len({tuple(t) for t in alone}) == 3


def test_abort_mid_prefill_and_mid_decode_frees_every_block(llm):
    engine, fresh = llm.engine, list(range(100, 117))  # nothing of it cached yet
    engine.add_request("prefill", fresh, SamplingParams(max_tokens=5))
    engine.step()  # 8 of 17 prompt tokens (max_num_batched_tokens=8)
    assert engine.scheduler.get_request("prefill").seqs[0].num_computed_tokens == 8
    assert engine.abort_request("prefill").outputs[0].finish_reason == "abort"
    engine.add_request("decode", fresh[:6], SamplingParams(n=2, max_tokens=10, ignore_eos=True))
    for _ in range(3):
        engine.step()
    assert all(s.num_output_tokens > 0 for s in engine.scheduler.get_request("decode").seqs)
    assert [o.finish_reason for o in engine.abort_request("decode").outputs] == ["abort", "abort"]
    assert engine.scheduler.stats().kv_cache_usage == (0.0,) and not engine.has_unfinished_requests()


def test_max_model_len_boundary(llm):
    """As vLLM: a prompt of exactly max_model_len gets one token; prompt + max_tokens past the
    limit stops at it with "length"; one token more is refused, naming max_model_len."""
    at_limit = llm.generate({"prompt_token_ids": [5] * 32}, SamplingParams(max_tokens=5, ignore_eos=True))[0]
    assert len(at_limit.outputs[0].token_ids) == 1 and at_limit.outputs[0].finish_reason == "length"
    over = llm.generate({"prompt_token_ids": [5] * 28}, SamplingParams(max_tokens=50, ignore_eos=True))[0]
    assert len(over.outputs[0].token_ids) == 4 and over.outputs[0].finish_reason == "length"
    with pytest.raises(ValueError, match="max_model_len=32"):
        llm.generate({"prompt_token_ids": [5] * 33})


def test_tokens_do_not_depend_on_batching_arrivals_or_preemption(tiny, llm):
    """Greedy and seeded (top-k/top-p) requests arriving while others run, with 6-token chunked
    prefill, a shared prefix and a 14-block pool that forces preemption (recompute): every
    request's tokens equal its run alone."""
    prompts = [[7, 8, 9, 10, 11] + [20 + 3 * i + j for j in range(2 + 4 * i)] for i in range(6)]
    params = [SamplingParams(temperature=0.9, top_p=0.9, top_k=50, seed=i, max_tokens=10, ignore_eos=True) if i % 2
              else SamplingParams(temperature=0, max_tokens=10, ignore_eos=True) for i in range(6)]
    alone = [llm.generate({"prompt_token_ids": p}, sp)[0].outputs[0].token_ids for p, sp in zip(prompts, params)]
    with LLM(str(tiny), dtype="float32", max_model_len=32, block_size=4, num_kv_blocks=14,
             max_num_batched_tokens=6) as tight:
        engine, finished, step = tight.engine, {}, 0
        while len(finished) < len(prompts):
            if step % 2 == 0 and step // 2 < len(prompts):
                engine.add_request(str(step // 2), prompts[step // 2], params[step // 2])
            finished.update({o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished})
            step += 1
        assert engine.scheduler.num_preemptions > 0 and engine.scheduler.stats().kv_cache_usage == (0.0,)
    assert [finished[str(i)] for i in range(len(prompts))] == alone
