"""Prefill with the PyTorch attention path's sequences grouped (``moe.layers.paged.prefill_groups``)
against one attention call per sequence, alternated in one process: ``LLM.generate`` of random
prompts, one output token each, wall time to the returned tokens.

    python tests/gpu/prefill_groups_ab.py --model DIR [--num-prompts 64] [--rounds 3]
        [--min-len 128] [--max-len 384] [--dtype bfloat16] [--memory 16GiB]

Part of ``tests/gpu/device_run.sh``. On a CPU the C++ prefill kernel serves every sequence in one
call whichever way, so both columns there time the same path.
"""

from __future__ import annotations

import argparse
import random
import sys
import time

from launch import LLM, SamplingParams
from moe.layers import paged


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python tests/gpu/prefill_groups_ab.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--min-len", type=int, default=128)
    p.add_argument("--max-len", type=int, default=384)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--memory", default="16GiB")
    args = p.parse_args(argv)
    if not 1 <= args.min_len <= args.max_len or args.num_prompts < 1 or args.rounds < 1:
        print("error: need 1 <= --min-len <= --max-len, --num-prompts >= 1 and --rounds >= 1", file=sys.stderr)
        return 2
    rng = random.Random(0)
    with LLM(args.model, dtype=args.dtype, memory=args.memory) as llm:
        vocab = llm.engine.model_config.vocab_size
        prompts = [{"prompt_token_ids": [rng.randrange(3, vocab) for _ in range(rng.randint(args.min_len, args.max_len))]}
                   for _ in range(args.num_prompts)]
        tokens = sum(len(q["prompt_token_ids"]) for q in prompts)
        params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
        llm.generate(prompts, params)  # warm-up: first-touch of the KV pages, kernels, allocator
        print(f"# device {llm.engine.executor.worker.device}, {args.num_prompts} prompts, {tokens} tokens, "
              f"{args.dtype}: ms per generate (prompt tok/s)")
        best = {"grouped": float("inf"), "one call per sequence": float("inf")}
        firsts = {}
        for r in range(args.rounds):
            for name, waste in (("grouped", 2.0), ("one call per sequence", 0.0)):
                paged.PREFILL_GROUP_WASTE = waste
                started = time.perf_counter()
                out = llm.generate(prompts, params)
                seconds = time.perf_counter() - started
                firsts[name] = [o.outputs[0].token_ids for o in out]
                best[name] = min(best[name], seconds)
                print(f"round {r} {name:>22}: {seconds * 1e3:9.1f} ms ({tokens / seconds:,.0f} tok/s)", flush=True)
        paged.PREFILL_GROUP_WASTE = 2.0
    same = sum(a == b for a, b in zip(firsts["grouped"], firsts["one call per sequence"]))
    print(f"best: grouped {best['grouped'] * 1e3:.1f} ms, one call per sequence "
          f"{best['one call per sequence'] * 1e3:.1f} ms: {best['one call per sequence'] / best['grouped']:.2f}x; "
          f"first tokens equal for {same} of {len(prompts)} prompts")
    return 0


if __name__ == "__main__":
    sys.exit(main())
