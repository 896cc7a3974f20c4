"""``python -m launch generate --model DIR --input IN.jsonl --output OUT.jsonl [flags]``.

Input lines: ``{"prompt": str}`` or ``{"prompt_token_ids": [...]}``, optionally with sampling
fields (``max_tokens``, ``temperature``, ``top_p``, ``top_k``, ``min_p``, ``seed``, ``stop``,
``stop_token_ids``, ``ignore_eos``, ``n``, ``logprobs``). Output lines repeat the input and add
``text``, ``token_ids``, ``finish_reason`` (lists of them when n > 1 under ``outputs``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Any

from launch.config_args import add_runtime_args, runtime_config_from_args
from launch.config_schema import ConfigError
from launch.core import SamplingParams
from launch.tokenizer import check_text

_SAMPLING_FIELDS = {f.name for f in dataclasses.fields(SamplingParams)}


def read_requests(path: Path) -> list[dict[str, Any]]:
    """Parse and validate the JSONL input; errors name the line."""
    rows = []
    with path.open() as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{n}: not valid JSON ({e.msg})") from e
            if not isinstance(row, dict) or ("prompt" in row) == ("prompt_token_ids" in row):
                raise ValueError(f"{path}:{n}: each line needs exactly one of 'prompt' or 'prompt_token_ids'")
            unknown = set(row) - _SAMPLING_FIELDS - {"prompt", "prompt_token_ids", "id"}
            if unknown:
                raise ValueError(f"{path}:{n}: unknown field(s) {sorted(unknown)}")
            check_prompt(row, f"{path}:{n}")
            rows.append(row)
    if not rows:
        raise ValueError(f"{path}: no requests")
    return rows


def check_prompt(row: dict[str, Any], where: str) -> None:
    """``prompt`` a non-empty valid-Unicode string, or ``prompt_token_ids`` a non-empty list of
    non-negative ints; else ValueError naming ``where``."""
    if "prompt" in row:
        prompt = row["prompt"]
        if not isinstance(prompt, str) or not prompt:
            raise ValueError(f"{where}: 'prompt' must be a non-empty string")
        check_text(prompt, f"{where}: 'prompt'")
        return
    ids = row["prompt_token_ids"]
    if not isinstance(ids, list) or not ids or any(isinstance(t, bool) or not isinstance(t, int) or t < 0
                                                   for t in ids):
        raise ValueError(f"{where}: 'prompt_token_ids' must be a non-empty list of non-negative integers")


def sampling_params_for(row: dict[str, Any], defaults: dict[str, Any], where: str) -> SamplingParams:
    fields = {**defaults, **{k: v for k, v in row.items() if k in _SAMPLING_FIELDS}}
    try:
        return SamplingParams(**fields)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{where}: {e}") from e


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m launch generate", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input", required=True, type=Path, help="JSONL of prompts")
    parser.add_argument("--output", required=True, type=Path, help="JSONL written with the completions")
    parser.add_argument("--max-tokens", type=int, default=None, help="default max_tokens per request")
    parser.add_argument("--temperature", type=float, default=None, help="default temperature (0 = greedy)")
    add_runtime_args(parser)
    args = parser.parse_args(argv)
    try:
        config = runtime_config_from_args(args)
        rows = read_requests(args.input)
        defaults = {k: v for k, v in (("max_tokens", args.max_tokens), ("temperature", args.temperature))
                    if v is not None}
        params = [sampling_params_for(r, defaults, f"{args.input}:{i + 1}") for i, r in enumerate(rows)]
    except (ConfigError, ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from launch.llm import LLM

    started = time.perf_counter()
    llm = LLM(config=config)
    try:
        prompts = [{k: r[k] for k in ("prompt", "prompt_token_ids") if k in r} for r in rows]
        outputs = llm.generate(prompts, params)
    finally:
        llm.shutdown()
    args.output.parent.mkdir(parents=True, exist_ok=True)
    with args.output.open("w") as f:
        for row, out in zip(rows, outputs):
            comps = [{"text": c.text, "token_ids": list(c.token_ids), "finish_reason": c.finish_reason}
                     for c in out.outputs]
            record = {**row, **comps[0]} if len(comps) == 1 else {**row, "outputs": comps}
            f.write(json.dumps(record) + "\n")
    generated = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    seconds = time.perf_counter() - started
    print(f"wrote {len(outputs)} completions ({generated} tokens) to {args.output} in {seconds:.1f}s")
    return 0
