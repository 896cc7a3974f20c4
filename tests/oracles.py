"""The test oracles, in one place: transformers' greedy generation, deterministic prompts,
and our engine's greedy run (single process unless a layout is passed)."""

from __future__ import annotations

import random

import torch

from launch import LLM, SamplingParams

NEW_TOKENS = 20


def hf_greedy(path, prompts: list[list[int]], n: int, *, attn_implementation: str | None = None) -> list[list[int]]:
    """transformers' generate, one prompt at a time (the oracle), fp32. ``attn_implementation``:
    e.g. "eager" where sdpa would not apply a model's sliding window the same way."""
    import transformers

    extra = {} if attn_implementation is None else {"attn_implementation": attn_implementation}
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **extra)
    model.generation_config.eos_token_id = None
    outs = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                                 pad_token_id=0)
            outs.append(out[0, len(p):].tolist())
    return outs


def make_prompts(seed: int, num: int, vocab: int, *, shared_prefix: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(2, vocab) for _ in range(shared_prefix)]
    return [prefix + [rng.randrange(2, vocab) for _ in range(rng.randrange(1, 40))] for _ in range(num)]


def run(path, prompts, n=NEW_TOKENS, **kwargs) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    with LLM(str(path), dtype="float32", **kwargs) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    for out in outs:
        assert out.finished and out.outputs[0].finish_reason == "length"
    return [list(o.outputs[0].token_ids) for o in outs]
