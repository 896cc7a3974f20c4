"""``min_p`` (vLLM semantics): drop tokens whose tempered probability is below ``min_p`` x the
most likely token's. Checked in the filter, in sampled frequencies, in validation, and wired
through the server, the JSONL reader of ``generate`` and the offline ``LLM`` API."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from launch.core.sampler import Sampler, apply_sampling_filters
from launch.core.sampling_params import SamplingParams
from launch.generate import sampling_params_for

torch.set_num_threads(1)

PROBS = torch.tensor([0.05, 0.5, 0.3, 0.1, 0.05])


def kept(row: torch.Tensor) -> set[int]:
    return set(torch.isfinite(row).nonzero().flatten().tolist())


def test_min_p_drops_tokens_below_the_scaled_threshold():
    logits = PROBS.log().expand(4, 5).clone()
    params = [SamplingParams(min_p=0.25), SamplingParams(min_p=0.7), SamplingParams(min_p=0.0),
              SamplingParams(min_p=1.0)]
    out = apply_sampling_filters(logits, params)
    assert out.shape == (4, 5) and out.dtype == torch.float32
    assert kept(out[0]) == {1, 2}  # threshold 0.125: 0.3 and 0.5 stay, 0.1 goes
    assert kept(out[1]) == {1}  # threshold 0.35: 0.3 goes
    assert kept(out[2]) == {0, 1, 2, 3, 4}  # off
    assert kept(out[3]) == {1}  # only the most likely token
    assert torch.allclose(out[0][[1, 2]], logits[0][[1, 2]])  # survivors keep their logits


def test_min_p_uses_the_tempered_distribution():
    # At T=2 the probabilities flatten: [0.05, 0.5, 0.3, 0.1, 0.05] ** 0.5, renormalised.
    logits = PROBS.log().unsqueeze(0)
    tempered = (logits / 2).softmax(-1)[0]
    threshold = 0.4 * tempered.max()
    want = {i for i in range(5) if tempered[i] >= threshold}
    out = apply_sampling_filters(logits, [SamplingParams(temperature=2.0, min_p=0.4)])
    assert kept(out[0]) == want == {1, 2, 3}  # 0.1 survives at T=2 but not at T=1 (0.2 x 0.5)
    assert kept(apply_sampling_filters(logits, [SamplingParams(temperature=1.0, min_p=0.4)])[0]) == {1, 2}


def test_min_p_then_top_k_and_top_p():
    logits = PROBS.log().unsqueeze(0)
    out = apply_sampling_filters(logits, [SamplingParams(min_p=0.15, top_k=2)])
    assert kept(out[0]) == {1, 2}
    out = apply_sampling_filters(logits, [SamplingParams(min_p=0.15, top_p=0.5)])
    # min_p keeps {1, 2, 3} (mass 0.9); renormalised, token 1 alone holds 0.556 >= 0.5.
    assert kept(out[0]) == {1}


def test_sampled_frequencies_follow_the_renormalised_survivors():
    rows = 20000
    logits = PROBS.log().expand(rows, 5).contiguous()
    out = Sampler(seed=7)(logits, [SamplingParams(min_p=0.25)] * rows)
    freq = torch.bincount(out.token_ids, minlength=5).float() / rows
    want = torch.tensor([0.0, 0.5, 0.3, 0.0, 0.0]) / 0.8
    assert freq[[0, 3, 4]].sum() == 0
    assert torch.allclose(freq, want, atol=0.02), freq  # ~5 standard errors


def test_min_p_validation():
    for bad in (-0.1, 1.5, True, "0.2", float("nan")):
        with pytest.raises(ValueError, match="min_p must be in"):
            SamplingParams(min_p=bad)
    assert SamplingParams(min_p=1).min_p_enabled and not SamplingParams().min_p_enabled
    assert SamplingParams(min_p=0.3, n=2, seed=1).for_sample(1).min_p == 0.3


def test_generate_jsonl_and_server_pass_min_p():
    assert sampling_params_for({"prompt": "x", "min_p": 0.2}, {}, "in:1").min_p == 0.2
    with pytest.raises(ValueError, match="in:1: min_p must be in"):
        sampling_params_for({"prompt": "x", "min_p": 2}, {}, "in:1")
    from launch.server.protocol import CompletionRequest
    from launch.server.serving import OpenAIServing

    params = OpenAIServing.sampling_params(CompletionRequest(prompt="x", min_p=0.3), 4, None)
    assert params.min_p == 0.3 and params.max_tokens == 4


def test_http_min_p_reaches_the_engine():
    import httpx

    from launch.server import build_app
    from tests.unit.server_fakes import FakeEngine, ServerThread

    engine = FakeEngine()
    cfg = SimpleNamespace(api_key=None, served_model_name=None, max_queue_len=8, expert_distribution_dir=None)
    with ServerThread(build_app(engine, cfg)) as srv:
        r = httpx.post(srv.base_url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2, "min_p": 0.05})
        assert r.status_code == 200, r.text
        r = httpx.post(srv.base_url + "/v1/chat/completions",
                       json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "min_p": 0.5})
        assert r.status_code == 200, r.text
        bad = httpx.post(srv.base_url + "/v1/completions", json={"prompt": "hi", "min_p": 1.5})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "min_p"
    assert [p.min_p for p in engine.seen_params] == [0.05, 0.5]


@pytest.mark.slow
def test_offline_min_p_one_is_greedy(tiny_ckpt):
    """min_p=1 keeps only the most likely token: sampling at T=1 then equals greedy decoding,
    through the engine, the worker's sampler and the offline API."""
    from launch import LLM

    model = tiny_ckpt
    prompts = [{"prompt_token_ids": [5, 6, 7, 8]}, {"prompt_token_ids": [9, 3, 40, 41, 42]}]
    with LLM(str(model), dtype="float32") as llm:
        greedy = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
        min_p = llm.generate(prompts, SamplingParams(temperature=1.0, min_p=1.0, max_tokens=12, ignore_eos=True))
        loose = llm.generate(prompts, SamplingParams(temperature=5.0, max_tokens=12, ignore_eos=True, seed=1))
    assert [o.outputs[0].token_ids for o in min_p] == [o.outputs[0].token_ids for o in greedy]
    assert [o.outputs[0].token_ids for o in loose] != [o.outputs[0].token_ids for o in greedy]
