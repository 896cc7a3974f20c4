"""Sampler: greedy, temperature, top-k / top-p masks, seeded reproducibility, logprobs."""

from __future__ import annotations

import math

import pytest
import torch

from launch.core.sampler import Sampler, apply_sampling_filters
from launch.core.sampling_params import SamplingParams

torch.set_num_threads(1)


def test_greedy_is_argmax_and_shapes():
    logits = torch.randn(5, 11, generator=torch.Generator().manual_seed(0))
    out = Sampler(seed=0)(logits, [SamplingParams(temperature=0.0)] * 5)
    assert out.token_ids.shape == (5,) and out.token_ids.dtype == torch.int64
    assert torch.equal(out.token_ids, logits.argmax(dim=-1))
    assert out.sampled_logprobs is None and out.topn_token_ids is None


def test_rejects_mismatched_inputs():
    sampler = Sampler(seed=0)
    with pytest.raises(ValueError, match=r"\[B, V\]"):
        sampler(torch.zeros(4), [SamplingParams()])
    with pytest.raises(ValueError, match="2 logits rows but 1 SamplingParams"):
        sampler(torch.zeros(2, 4), [SamplingParams()])
    with pytest.raises(ValueError, match="output indices"):
        sampler(torch.zeros(1, 4), [SamplingParams()], [0, 1])


def test_top_k_keeps_exactly_the_k_largest():
    logits = torch.randn(3, 20, generator=torch.Generator().manual_seed(1))
    params = [SamplingParams(top_k=3), SamplingParams(top_k=-1), SamplingParams(top_k=25)]
    out = apply_sampling_filters(logits, params)
    assert out.shape == (3, 20)
    kept = torch.isfinite(out[0])
    assert kept.sum() == 3
    assert set(kept.nonzero().flatten().tolist()) == set(logits[0].topk(3).indices.tolist())
    assert torch.allclose(out[0][kept], logits[0][kept])
    assert torch.isfinite(out[1:]).all()  # -1 and k >= V are off


def test_top_p_keeps_smallest_set_reaching_p():
    probs = torch.tensor([0.125, 0.5, 0.125, 0.25])
    logits = probs.log().expand(3, 4).clone()
    params = [SamplingParams(top_p=0.75), SamplingParams(top_p=0.76), SamplingParams(top_p=0.1)]
    out = apply_sampling_filters(logits, params)
    kept = [set(torch.isfinite(r).nonzero().flatten().tolist()) for r in out]
    assert kept[0] == {1, 3}  # 0.5 + 0.25 reaches 0.75
    assert len(kept[1]) == 3 and {1, 3} < kept[1]  # one of the 0.125 ties is needed
    assert kept[2] == {1}  # the top token always stays


def test_top_k_then_top_p_and_temperature_scaling():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]])
    out = apply_sampling_filters(logits, [SamplingParams(temperature=2.0, top_k=3, top_p=0.5)])
    # After top-k and T=2, softmax of [2, 1.5, 1] gives the top token ~0.51 >= 0.5.
    assert torch.isfinite(out).flatten().tolist() == [True, False, False, False, False]
    assert out[0, 0].item() == pytest.approx(2.0)


def test_sampled_tokens_respect_masks():
    logits = torch.randn(1, 30, generator=torch.Generator().manual_seed(2)).expand(400, 30).contiguous()
    out = Sampler(seed=3)(logits, [SamplingParams(top_k=4)] * 400)
    assert set(out.token_ids.tolist()) <= set(logits[0].topk(4).indices.tolist())
    assert len(set(out.token_ids.tolist())) > 1


def test_temperature_sampling_matches_softmax_distribution():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]]).expand(20000, 4).contiguous()
    out = Sampler(seed=4)(logits, [SamplingParams(temperature=0.7)] * 20000)
    freq = torch.bincount(out.token_ids, minlength=4).float() / 20000
    want = (logits[0] / 0.7).softmax(-1)
    # Binomial standard error <= sqrt(0.25 / 20000) ~ 0.0035: 5 sigma.
    assert torch.allclose(freq, want, atol=0.018), (freq, want)


def test_seeded_rows_do_not_depend_on_the_batch():
    gen = torch.Generator().manual_seed(5)
    row = torch.randn(1, 64, generator=gen)
    others = torch.randn(6, 64, generator=gen)
    seeded = SamplingParams(temperature=1.0, seed=1234)
    alone = [Sampler(seed=0)(row, [seeded], [k]).token_ids.item() for k in range(20)]
    mixed_params = [SamplingParams(temperature=0.9)] * 3 + [seeded] + [SamplingParams(temperature=0.0)] * 3
    batch = torch.cat([others[:3], row, others[3:]])
    in_batch = [Sampler(seed=99)(batch, mixed_params, [7, 7, 7, k, 7, 7, 7]).token_ids[3].item() for k in range(20)]
    assert alone == in_batch
    assert len(set(alone)) > 3  # the stream moves with the output index
    other_seed = [Sampler(seed=0)(row, [SamplingParams(seed=4321)], [k]).token_ids.item() for k in range(20)]
    assert other_seed != alone


def test_unseeded_rows_follow_the_sampler_seed():
    logits = torch.zeros(50, 100)
    params = [SamplingParams()] * 50
    a, b, c = Sampler(seed=1)(logits, params), Sampler(seed=1)(logits, params), Sampler(seed=2)(logits, params)
    assert torch.equal(a.token_ids, b.token_ids) and not torch.equal(a.token_ids, c.token_ids)


def test_logprobs_are_raw_model_logprobs_with_top_n():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0], [0.0, 0.0, 5.0, 1.0], [1.0, 1.0, 1.0, 1.0]])
    params = [SamplingParams(temperature=0.0, logprobs=2), SamplingParams(temperature=0.5, logprobs=0),
              SamplingParams(temperature=0.0)]
    out = Sampler(seed=0)(logits, params)
    raw = logits.log_softmax(-1)
    assert out.sampled_logprobs.shape == (3,) and out.topn_logprobs.shape == (3, 2)
    assert torch.allclose(out.sampled_logprobs, raw.gather(1, out.token_ids[:, None]).squeeze(1))
    assert out.topn_token_ids[0].tolist() == [1, 2]
    sampled = out.to_sampled_tokens(params)
    assert sampled.token_ids == out.token_ids.tolist()
    first = sampled.logprobs[0]
    assert list(first) == [1, 2] and first[1] == pytest.approx(raw[0, 1].item())
    assert list(sampled.logprobs[1]) == [out.token_ids[1].item()]  # logprobs=0: sampled token only
    assert sampled.logprobs[2] is None
    assert math.isclose(sum(math.exp(v) for v in raw[2].tolist()), 1.0, rel_tol=1e-6)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_seeded_rows_do_not_depend_on_the_batch():
    gen = torch.Generator().manual_seed(6)
    row = torch.randn(1, 1000, generator=gen).cuda()
    batch = torch.cat([torch.randn(3, 1000, generator=gen).cuda(), row])
    seeded = SamplingParams(seed=77, top_k=50, top_p=0.9)
    params = [SamplingParams(), SamplingParams(temperature=0.0), SamplingParams(top_p=0.5), seeded]
    alone = [Sampler(seed=0)(row, [seeded], [k]).token_ids.item() for k in range(10)]
    mixed = [Sampler(seed=1)(batch, params, [0, 0, 0, k]).token_ids[3].item() for k in range(10)]
    assert alone == mixed
    assert set(alone) <= set(row[0].topk(50).indices.tolist())
    out = Sampler(seed=0)(batch, params)
    assert out.token_ids.device.type == "cuda" and out.token_ids.shape == (4,)
