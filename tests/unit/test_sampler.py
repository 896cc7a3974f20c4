"""Sampler: greedy, temperature, top-k / top-p masks, seeded reproducibility, logprobs."""

from __future__ import annotations

import dataclasses
import math
import os
import subprocess
import sys

import pytest
import torch

from launch.bench.sampler import sort_reference_filters
from launch.core.sampler import (
    ONE_PASS_MAX_VOCAB,
    Sampler,
    apply_sampling_filters,
    draw_from_weights,
    search_fraction,
    seeded_uniform,
    sorted_values,
)
from launch.core.sampling_params import SEED_MAX, SEED_MIN, SamplingParams

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


# ---------------------------------------------------------------- the fast paths against a plain oracle


@pytest.mark.parametrize("vocab", [7, 300, 3000])
def test_filters_keep_what_the_sort_reference_keeps(vocab):
    gen = torch.Generator().manual_seed(vocab)
    settings = [dict(temperature=t, top_k=k, top_p=p, min_p=m)
                for t in (0.5, 1.0, 1.7) for k in (-1, 1, 3, 11, vocab - 1, vocab + 5)
                for p in (1.0, 0.3, 0.9, 0.99) for m in (0.0, 0.05)]
    params = [SamplingParams(**s) for s in settings]
    logits = torch.randn(len(params), vocab, generator=gen) * 3
    out = apply_sampling_filters(logits, params)
    want = sort_reference_filters(logits, params)
    assert out.shape == (len(params), vocab)
    kept, want_kept = torch.isfinite(out), torch.isfinite(want)
    for row, s in enumerate(settings):
        assert torch.equal(kept[row], want_kept[row]), s
    temps = torch.tensor([s["temperature"] for s in settings]).unsqueeze(1)
    assert torch.equal(out[kept], (logits / temps)[kept])


def test_ties_at_the_last_kept_value_keep_the_lowest_ids():
    logits = torch.tensor([[0.0, 1.0, 1.0, 2.0, 1.0, 1.0]])
    kept = torch.isfinite(apply_sampling_filters(logits, [SamplingParams(top_k=3)]))[0]
    assert kept.nonzero().flatten().tolist() == [1, 2, 3]


# Logits over V = 600: five leading tokens, then a flat tail. With FEW = 256, top-k <= 2 takes the
# top-k path, a top-p nucleus of <= 2 tokens the sorted-values path drawing among candidates, a
# larger one the sorted-values path drawing over the whole row, no top-k/top-p the plain path.
_HEAD = [3.0, 2.5, 2.0, 1.5, 1.0]
_PATHS = {
    "top-k": SamplingParams(temperature=0.9, top_k=2),
    "top-p, few kept": SamplingParams(temperature=1.0, top_p=0.5),
    "top-p, many kept": SamplingParams(temperature=1.0, top_p=0.8),
    "top-k and top-p": SamplingParams(temperature=1.2, top_k=4, top_p=0.7),
    "temperature": SamplingParams(temperature=0.8),
    "min-p": SamplingParams(temperature=1.0, min_p=0.2),
}


def _head_logits(rows: int) -> torch.Tensor:
    row = torch.full((600,), -4.0)
    row[: len(_HEAD)] = torch.tensor(_HEAD)
    return row.expand(rows, 600).contiguous()


@pytest.mark.parametrize("path", list(_PATHS))
def test_draws_follow_the_filtered_distribution_on_every_path(path):
    n = 20000
    params = [_PATHS[path]] * n
    logits = _head_logits(n)
    out = Sampler(seed=11)(logits, params).token_ids
    want = apply_sampling_filters(logits[:1], params[:1]).softmax(dim=-1)[0].double()  # [V]
    freq = torch.bincount(out, minlength=600).double() / n
    assert freq[want == 0].sum() == 0  # nothing outside the kept set
    tail = slice(len(_HEAD), None)
    observed = torch.cat([freq[: len(_HEAD)], freq[tail].sum().unsqueeze(0)])
    expected = torch.cat([want[: len(_HEAD)], want[tail].sum().unsqueeze(0)])
    sigma = (expected * (1 - expected) / n).sqrt()
    assert ((observed - expected).abs() <= 5 * sigma + 1e-12).all(), (path, observed, expected)


@pytest.mark.parametrize("path", list(_PATHS))
def test_seeded_rows_do_not_depend_on_the_batch_on_every_path(path):
    seeded = dataclasses.replace(_PATHS[path], seed=2024)
    row = _head_logits(1) + torch.randn(1, 600, generator=torch.Generator().manual_seed(3)) * 0.5
    others = [p for name, p in _PATHS.items() if name != path] + [SamplingParams(temperature=0.0)]
    batch = torch.cat([_head_logits(len(others)), row])
    alone = [Sampler(seed=0)(row, [seeded], [k]).token_ids.item() for k in range(30)]
    mixed = [Sampler(seed=5)(batch, others + [seeded], [3] * len(others) + [k]).token_ids[-1].item()
             for k in range(30)]
    assert alone == mixed
    assert len(set(alone)) > 1


def test_search_fraction_matches_a_full_fp64_running_sum():
    gen = torch.Generator().manual_seed(7)
    for width in (1, 63, 64, 65, 200, 1000):
        weights = torch.rand(40, width, generator=gen)
        weights[weights < 0.3] = 0  # zeros, and whole zero blocks in some rows
        weights[:10, : width // 2] = 0
        weights[:, 0] += (weights.sum(dim=-1) == 0).float()  # at least one positive per row
        fraction = torch.rand(40, generator=gen, dtype=torch.float64)
        fraction[:3] = torch.tensor([0.0, 1 - 2.0**-53, 0.5])
        cdf = weights.double().cumsum(dim=-1)
        target = (fraction * cdf[:, -1]).unsqueeze(1)
        want = {right: torch.searchsorted(cdf, target, right=right).squeeze(1).clamp(max=width - 1)
                for right in (True, False)}
        for vocab in (width, ONE_PASS_MAX_VOCAB + 1):  # one fp64 pass; two levels (blocks of BLOCK)
            for right in (True, False):
                got = search_fraction(weights, fraction, right=right, vocab=vocab)
                assert got.shape == (40,) and got.dtype == torch.int64
                assert torch.equal(got, want[right]), (width, right, vocab)
            drawn = draw_from_weights(weights, fraction, vocab=vocab)
            assert (weights.gather(1, drawn.unsqueeze(1)) > 0).all()  # never a zero-weight column


def test_seeded_uniform_is_stable_across_processes():
    values = [seeded_uniform(s, i) for s in (0, 1, -5, SEED_MIN, SEED_MAX) for i in range(50)]
    assert all(0.0 <= v < 1.0 for v in values) and len(set(values)) == len(values)
    assert abs(sum(seeded_uniform(9, i) for i in range(20000)) / 20000 - 0.5) < 0.01
    code = "from launch.core.sampler import seeded_uniform; print(repr(seeded_uniform(1234, 17)))"
    env = {**os.environ, "PYTHONHASHSEED": "4321"}
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert float(other.stdout) == seeded_uniform(1234, 17)


def test_distinct_seeds_give_distinct_streams():
    """No two accepted seeds share a stream: not -1 and -2 (equal under Python's int hash), not
    seeds 2**61 - 1 apart (that hash works modulo 2**61 - 1), not the ends of the int64 range."""
    for a, b in ((-1, -2), (0, 2**61 - 1), (7, 7 + 2**61 - 1), (-3, -3 - (2**61 - 1)), (SEED_MIN, SEED_MAX),
                 (0, -1), (SEED_MIN, 0)):
        assert [seeded_uniform(a, i) for i in range(8)] != [seeded_uniform(b, i) for i in range(8)], (a, b)
    values = [seeded_uniform(s, i) for s in range(-200, 200) for i in range(30)]
    assert len(set(values)) == len(values)  # 12,000 draws of 53 bits: no repeats
    for seed, index in ((SEED_MAX + 1, 0), (SEED_MIN - 1, 0), (0, -1)):
        with pytest.raises(ValueError, match=r"must be in \["):
            seeded_uniform(seed, index)


def test_completions_of_one_seeded_request_draw_differently():
    """The n completions of a seeded request (seeds seed + j) sample different tokens, seed -2
    included, while each one alone repeats itself."""
    logits = torch.zeros(1, 1000)  # uniform: every u picks its own token
    for seed in (-2, -1, 0, 5, SEED_MAX):
        request = SamplingParams(temperature=1.0, n=2, seed=seed)
        rows = [request.for_sample(j) for j in range(2)]
        draws = [[Sampler(seed=0)(logits, [p], [k]).token_ids.item() for k in range(10)] for p in rows]
        assert draws[0] != draws[1], seed
        assert draws[0] == [Sampler(seed=1)(logits, [rows[0]], [k]).token_ids.item() for k in range(10)]


def test_top_p_nucleus_is_the_fp64_one_on_a_flat_large_vocabulary():
    logits = torch.randn(16, 40000, generator=torch.Generator().manual_seed(8)) * 3
    params = [SamplingParams(temperature=0.8, top_p=p) for p in (0.5, 0.9, 0.95, 0.99)] * 4
    kept = torch.isfinite(apply_sampling_filters(logits, params)).sum(dim=-1)
    probs, _ = (logits / 0.8).softmax(dim=-1).double().sort(dim=-1, descending=True)
    running = probs.cumsum(dim=-1)
    top_p = torch.tensor([p.top_p for p in params], dtype=torch.float64).unsqueeze(1)
    want = torch.searchsorted(running, top_p * running[:, -1:]).squeeze(1) + 1
    assert torch.equal(kept, want)
    assert (kept <= 40000 // 256).any() and (kept > 40000 // 256).any()  # the sampler's two draw paths


def test_an_empty_batch_and_a_one_token_vocabulary():
    assert Sampler(seed=0)(torch.zeros(0, 10), []).token_ids.shape == (0,)
    params = [SamplingParams(top_p=0.5), SamplingParams(top_k=1), SamplingParams(temperature=0.5, seed=3)]
    assert Sampler(seed=0)(torch.randn(3, 1), params).token_ids.tolist() == [0, 0, 0]


def test_sorted_values_equal_a_torch_sort_whatever_the_width():
    x = torch.rand(5, 3000, generator=torch.Generator().manual_seed(9))
    x[:, ::7] = 0.0  # ties, as dropped tokens make them
    want = x.sort(dim=-1, descending=True).values  # what other devices run
    for width in (1, 3000 // 256, 3000 // 256 + 1, 1500, 3000):
        got = sorted_values(x, width)
        assert got.shape == (5, width) and got.is_contiguous()
        assert torch.equal(got, want[:, :width]), width


def test_two_level_draws_follow_the_weights():
    gen = torch.Generator().manual_seed(10)
    row = torch.rand(300, generator=gen) ** 4  # uneven weights, some near zero
    row[::11] = 0.0
    n = 40000
    drawn = draw_from_weights(row.expand(n, 300).contiguous(), torch.rand(n, generator=gen, dtype=torch.float64),
                              vocab=ONE_PASS_MAX_VOCAB + 1)
    freq = torch.bincount(drawn, minlength=300).double() / n
    want = (row / row.sum()).double()
    assert freq[want == 0].sum() == 0
    assert ((freq - want).abs() <= 5 * (want * (1 - want) / n).sqrt() + 1e-12).all()
