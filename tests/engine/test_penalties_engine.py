"""Penalties, min_tokens and prompt_logprobs through the whole engine (tiny fp32 checkpoint, one
process), against transformers: a greedy reference loop that applies vLLM's formulas to the model's
logits step by step, and the log-softmax of one full forward over the prompt. Every test also runs
with the step messages going through the socket transport's encodings (``launch.core.wire`` and
``StepResult.to_bytes``), as Ray ranks receive them."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from launch import LLM, SamplingParams
from launch.core.wire import decode_batch, encode_batch
from launch.worker import StepResult
from tests.conftest import write_hf_checkpoint
from tests.oracles import make_prompts

NEW = 12
EOS = 1  # tests.conftest.COMMON's eos_token_id
# the step's scheduling paths: chunked prefill with prefix-cache hits, and preemption (recompute)
LAYOUTS = {
    "chunked_prefix": dict(max_num_batched_tokens=16, block_size=4, enable_prefix_caching=True, max_model_len=128),
    "preempt": dict(max_num_batched_tokens=32, block_size=4, num_kv_blocks=24, max_model_len=80),
}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_hf_checkpoint("deepseek_v3", tmp_path_factory.mktemp("penalties") / "dsv3", seed=1)


@pytest.fixture(scope="module")
def hf_model(ckpt):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()


def reference(model, prompt: list[int], params: SamplingParams, eos: tuple[int, ...] = (EOS,)) -> list[int]:
    """Greedy decoding as vLLM defines the options, one full forward per token: min_tokens masks
    the EOS and stop ids (-inf) while fewer outputs exist, then the repetition penalty divides
    positive / multiplies other logits of prompt-or-output tokens, then frequency x count and
    presence are subtracted for output tokens; stops on EOS (unless ignore_eos) or a stop id."""
    out: list[int] = []
    with torch.no_grad():
        while len(out) < params.max_tokens:
            logits = model(torch.tensor([prompt + out])).logits[0, -1].float().clone()  # [V]
            if len(out) < params.min_tokens:
                logits[list({*params.stop_token_ids, *eos})] = float("-inf")
            for t in set(prompt) | set(out):
                logits[t] = logits[t] / params.repetition_penalty if logits[t] > 0 \
                    else logits[t] * params.repetition_penalty
            for t, count in Counter(out).items():
                logits[t] = logits[t] - params.frequency_penalty * count
                logits[t] = logits[t] - params.presence_penalty
            out.append(int(logits.argmax()))
            stops = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos))
            if len(out) >= params.min_tokens and out[-1] in stops:
                break
    return out


def through_wire(llm: LLM) -> None:
    """Send the in-process rank its batches as the socket transport does: encoded, decoded on the
    worker's side, the reply through ``StepResult`` bytes."""
    worker = llm.engine.executor.worker

    def execute(output, collect_load):
        reply = worker.execute(decode_batch(encode_batch(output.batches[0])), collect_load)
        return [StepResult.from_bytes(reply.to_bytes())]

    llm.engine.executor.execute = execute


def generate(ckpt, prompts, params, *, wire: bool, **engine) -> tuple[list, LLM]:
    with LLM(str(ckpt), dtype="float32", **engine) as llm:
        if wire:
            through_wire(llm)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        return outs, llm.engine.scheduler.stats()


@pytest.mark.parametrize("wire", [False, True], ids=["in_process", "wire"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_penalties_match_the_reference_loop(ckpt, hf_model, layout, wire):
    """Mixed batch: three penalty settings and a plain greedy request beside them (whose tokens must
    not move); under chunked prefill with prefix-cache hits (penalised rows admitted on cached KV)
    and under preemption (their histories restart)."""
    prompts = make_prompts(7, 8, 96, shared_prefix=9)
    settings = [dict(repetition_penalty=1.6), dict(repetition_penalty=0.7, frequency_penalty=0.6, presence_penalty=-0.4),
                dict(presence_penalty=1.5, frequency_penalty=1.0), {}]
    params = [SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True, **settings[i % 4])
              for i in range(len(prompts))]
    outs, stats = generate(ckpt, prompts, params, wire=wire, **LAYOUTS[layout])
    got = [list(o.outputs[0].token_ids) for o in outs]
    want = [reference(hf_model, p, sp) for p, sp in zip(prompts, params)]
    assert got == want
    plain = [reference(hf_model, p, SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True))
             for p in prompts[:3]]
    assert plain != want[:3]  # the penalties changed these outputs: the comparison has teeth
    if layout == "chunked_prefix":
        assert stats.prefix_cache_hits > 0
    else:
        assert stats.num_preemptions > 0


@pytest.mark.parametrize("wire", [False, True], ids=["in_process", "wire"])
def test_min_tokens_blocks_stop_ids_and_eos(ckpt, hf_model, tmp_path, wire):
    """The greedy first token made a stop id, then the checkpoint's EOS: alone it ends the output at
    once; with min_tokens it cannot come before min_tokens tokens exist (masked, as the reference
    loop), also with ignore_eos (vLLM masks the EOS ids whatever ignore_eos says)."""
    prompt = make_prompts(3, 1, 96)[0]
    first = reference(hf_model, prompt, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))[0]
    assert first != EOS
    runs = [SamplingParams(temperature=0.0, max_tokens=NEW, stop_token_ids=[first]),
            SamplingParams(temperature=0.0, max_tokens=NEW, stop_token_ids=[first], min_tokens=4),
            SamplingParams(temperature=0.0, max_tokens=NEW, stop_token_ids=[first], min_tokens=NEW)]
    outs, _ = generate(ckpt, [prompt] * 3, runs, wire=wire)
    assert outs[0].outputs[0].token_ids == [first] and outs[0].outputs[0].stop_reason == first
    for out, params in zip(outs[1:], runs[1:]):
        tokens = out.outputs[0].token_ids
        assert first not in tokens[:params.min_tokens] and len(tokens) >= params.min_tokens
        assert tokens == reference(hf_model, prompt, params)
    eos_ckpt = write_hf_checkpoint("deepseek_v3", tmp_path / "eos", seed=1, eos_token_id=first)
    runs = [SamplingParams(temperature=0.0, max_tokens=NEW),
            SamplingParams(temperature=0.0, max_tokens=NEW, min_tokens=5),
            SamplingParams(temperature=0.0, max_tokens=NEW, min_tokens=5, ignore_eos=True)]
    outs, _ = generate(eos_ckpt, [prompt] * 3, runs, wire=wire)
    assert outs[0].outputs[0].token_ids == [first] and outs[0].outputs[0].finish_reason == "stop"
    for out, params in zip(outs[1:], runs[1:]):
        tokens = out.outputs[0].token_ids
        assert first not in tokens[:5]
        assert tokens == reference(hf_model, prompt, params, eos=(first,))


def full_forward_entries(model, prompt: list[int], n: int) -> list[dict[int, float]]:
    """Per prompt position i >= 1: {prompt[i]: logprob, top-n...} from one forward's log_softmax."""
    with torch.no_grad():
        logprobs = model(torch.tensor([prompt])).logits[0].float().log_softmax(-1)  # [P, V]
    out = []
    for i in range(1, len(prompt)):
        entry = {prompt[i]: logprobs[i - 1, prompt[i]].item()}
        top = logprobs[i - 1].topk(n) if n else None
        for t, lp in zip(*(top.indices.tolist(), top.values.tolist()) if n else ((), ())):
            entry.setdefault(t, lp)
        out.append(entry)
    return out


def assert_prompt_logprobs(got: list | None, want: list[dict[int, float]]) -> None:
    assert got is not None and got[0] is None and len(got) == len(want) + 1
    for entry, ref in zip(got[1:], want):
        assert list(entry) == list(ref)  # the prompt token first, then the top-n in order
        assert list(entry.values()) == pytest.approx(list(ref.values()), abs=1e-4)


@pytest.mark.parametrize("wire", [False, True], ids=["in_process", "wire"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_prompt_logprobs_equal_a_full_forward(ckpt, hf_model, layout, wire):
    """Chunked prompts (16-token steps), prompts sharing cached blocks (the prefix cache is not read
    for them), n = 2 and preemption: one entry per prompt token, never twice, equal to the log_softmax
    of one forward over the prompt; the generated tokens stay greedy's."""
    prompts = make_prompts(11, 6, 96, shared_prefix=12)
    prompts[1] = prompts[0][:]  # the same prompt again: its blocks are cached by the time it runs
    params = [SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, prompt_logprobs=k % 3,
                             n=2 if k == 2 else 1) for k in range(len(prompts))]
    outs, _ = generate(ckpt, prompts, params, wire=wire, **LAYOUTS[layout])
    for out, prompt, p in zip(outs, prompts, params):
        assert_prompt_logprobs(out.prompt_logprobs, full_forward_entries(hf_model, prompt, p.prompt_logprobs))
        for completion in out.outputs:
            assert completion.token_ids == reference(hf_model, prompt, SamplingParams(
                temperature=0.0, max_tokens=4, ignore_eos=True))


def test_prompt_logprobs_skip_reading_the_prefix_cache(ckpt, hf_model):
    """A request scoring its prompt computes every position even when the cache holds its blocks
    (hits do not grow), and the blocks it computes serve a later plain request (hits grow)."""
    prompt = make_prompts(5, 1, 96, shared_prefix=20)[0]
    with LLM(str(ckpt), dtype="float32", block_size=4, enable_prefix_caching=True) as llm:
        plain = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
        llm.generate({"prompt_token_ids": prompt}, plain)
        hits = llm.engine.scheduler.stats().prefix_cache_hits
        assert hits == 0
        scored = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0.0, max_tokens=2,
                                                                           prompt_logprobs=1))[0]
        assert llm.engine.scheduler.stats().prefix_cache_hits == hits
        assert_prompt_logprobs(scored.prompt_logprobs, full_forward_entries(hf_model, prompt, 1))
        llm.generate({"prompt_token_ids": prompt}, plain)
        assert llm.engine.scheduler.stats().prefix_cache_hits > hits
