"""The sweep's prompts: a workload file of this sweep's own, or a shipped workload by name.

A ``.txt`` file holds one prompt per non-empty line; a ``.jsonl`` file one JSON object per
line with ``"prompt"`` (text) or ``"prompt_token_ids"`` (a list of ints, for checkpoints
without a tokenizer). Anything else is handed to ``launch.workloads.load_workload`` (the
shipped prompt sets: ``prose``, ``code``, ``prose+code``, ...).
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

Prompt = str | tuple[int, ...]


def read_prompt_file(path: Path) -> list[Prompt]:
    """Prompts of a .txt / .jsonl file; ValueError naming the file and line otherwise."""
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".txt":
        return [line for line in text.splitlines() if line.strip()]
    if path.suffix != ".jsonl":
        raise ValueError(f"workload file {path}: expected .txt (one prompt per line) or .jsonl")
    prompts: list[Prompt] = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"workload file {path} line {n}: not JSON ({e.msg})") from e
        if isinstance(obj, dict) and isinstance(obj.get("prompt"), str):
            prompts.append(obj["prompt"])
        elif isinstance(obj, dict) and isinstance(obj.get("prompt_token_ids"), list) and obj["prompt_token_ids"] \
                and all(isinstance(t, int) for t in obj["prompt_token_ids"]):
            prompts.append(tuple(obj["prompt_token_ids"]))
        else:
            raise ValueError(f"workload file {path} line {n}: needs \"prompt\" (text) or \"prompt_token_ids\" (ints)")
    return prompts


def load_prompts(spec: str, num_prompts: int | None = None) -> tuple[str, list[Prompt]]:
    """(name, prompts) for ``spec``; with ``num_prompts`` the first that many, cycling when
    the workload has fewer."""
    path = Path(spec)
    if path.is_file():
        prompts = read_prompt_file(path)
        name = path.name
    else:
        try:
            from launch.workloads import load_workload
        except ImportError as e:
            raise ValueError(f"workload {spec!r} is not a file, and shipped workloads (launch.workloads) "
                             "are not installed") from e
        prompts, name = list(load_workload(spec)), spec
    if not prompts:
        raise ValueError(f"workload {spec!r} has no prompts")
    if num_prompts is not None:
        prompts = list(itertools.islice(itertools.cycle(prompts), num_prompts))
    return name, prompts
