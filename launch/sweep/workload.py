"""The sweep's prompts: a workload file of this sweep's own, or a shipped workload by name.

A ``.txt`` file holds one prompt per non-empty line; a ``.jsonl`` file one JSON object per
line with ``"prompt"`` (text) or ``"prompt_token_ids"`` (a list of ints, for checkpoints
without a tokenizer), read by ``launch.workloads.read_workload_file``. Anything else is handed
to ``launch.workloads.load_workload`` (the shipped prompt sets: ``prose``, ``code``,
``prose+code``, ...).

``model_token_ids`` and ``check_fits`` check the prompts against the checkpoint a point
runs (its tokenizer, vocabulary and max_model_len) before anything runs: a request the
engine would refuse, or cut short of ``--max-tokens``, is not a measurement.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from pathlib import Path

from launch.workloads import Prompt, load_workload, read_workload_file


def load_prompts(spec: str, num_prompts: int | None = None) -> tuple[str, list[Prompt]]:
    """(name, prompts) for ``spec``; with ``num_prompts`` the first that many, cycling when
    the workload has fewer."""
    path = Path(spec)
    if path.is_file():
        prompts = read_workload_file(path)
        name = path.name
    else:
        prompts, name = list(load_workload(spec)), spec
    if not prompts:
        raise ValueError(f"workload {spec!r} has no prompts")
    if num_prompts is not None:
        prompts = list(itertools.islice(itertools.cycle(prompts), num_prompts))
    return name, prompts


def model_token_ids(prompts: Sequence[Prompt], model: str | Path, name: str) -> tuple[list[list[int]], int]:
    """(token ids of every prompt as the engine runs them on checkpoint ``model``, its
    max_position_embeddings); ValueError naming workload ``name``'s first prompt that can never
    run there (text without a tokenizer.json, a token id outside the vocabulary)."""
    from launch.tokenizer import Tokenizer
    from moe.config import ModelConfig

    path = Path(model)
    try:
        mc = ModelConfig.from_hf(path)
    except ValueError as e:
        raise ValueError(f"model {model}: {e}") from None
    tokenizer = Tokenizer.from_dir(path) if (path / "tokenizer.json").is_file() else None
    token_lists = []
    for n, prompt in enumerate(prompts, 1):
        if isinstance(prompt, str):
            if tokenizer is None:
                raise ValueError(f"workload {name}: prompt {n} is text but {model} has no tokenizer.json: "
                                 "give \"prompt_token_ids\" in a .jsonl workload")
            ids = tokenizer.encode(prompt)
        else:
            ids = [int(t) for t in prompt]
        bad = [t for t in ids if not 0 <= t < mc.vocab_size]
        if bad:
            raise ValueError(f"workload {name}: prompt {n} has token id {bad[0]}, outside the vocabulary "
                             f"[0, {mc.vocab_size}) of {model}")
        token_lists.append(ids)
    return token_lists, mc.max_position_embeddings


def check_fits(token_lists: Sequence[Sequence[int]], max_tokens: int, max_model_len: int) -> None:
    """ValueError when ``max_tokens`` after the longest prompt does not fit in ``max_model_len``
    (the engine would end those requests early: fewer tokens than asked, quietly)."""
    if max_tokens >= max_model_len:  # the words of ``profile run``'s refusal
        raise ValueError(f"--max-tokens {max_tokens} leaves no room for a prompt in max_model_len {max_model_len}")
    n, longest = max(enumerate(token_lists, 1), key=lambda x: len(x[1]))
    if len(longest) + max_tokens > max_model_len:
        raise ValueError(f"prompt {n} of {len(longest)} tokens + --max-tokens {max_tokens} exceeds "
                         f"max_model_len {max_model_len}")
