"""The shipped training text, by kind, and random training windows over it.

Kinds (``CORPUS_KINDS``) match the shipped workloads (``launch.workloads``) so that a model
trained here routes each kind of prompt differently:

- ``prose``: ``launch/data/*.txt`` (the tokenizer's own training text) and
  ``launch/data/corpus/prose.txt``;
- ``code``, ``tables``, ``french``: ``launch/data/corpus/<kind>.txt``.

The workload prompts are not part of the training text. Batches draw each row from one
kind (kinds in turn, so every batch holds all of them), at a uniformly random offset, and
start it with ``<|bos|>`` as served prompts do.
"""

from __future__ import annotations

from pathlib import Path

import torch

from launch.tokenizer import Tokenizer

DATA_DIR = Path(__file__).resolve().parent.parent / "data"
CORPUS_DIR = DATA_DIR / "corpus"
CORPUS_KINDS: tuple[str, ...] = ("prose", "code", "tables", "french")


def corpus_files(kind: str) -> list[Path]:
    """The text files of one kind, in a fixed order."""
    if kind not in CORPUS_KINDS:
        raise ValueError(f"unknown corpus kind {kind!r}; expected one of {CORPUS_KINDS}")
    files = sorted(DATA_DIR.glob("*.txt")) if kind == "prose" else []
    files += [CORPUS_DIR / f"{kind}.txt"]
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise FileNotFoundError(f"training text missing: {', '.join(missing)}")
    return files


def load_corpus() -> dict[str, str]:
    """kind -> its text (files joined by a blank line)."""
    return {k: "\n\n".join(f.read_text(encoding="utf-8") for f in corpus_files(k)) for k in CORPUS_KINDS}


class TokenWindows:
    """Each kind's text tokenized once; ``sample(gen, batch, seq_len)`` draws training rows."""

    def __init__(self, tokenizer: Tokenizer, texts: dict[str, str]) -> None:
        if tokenizer.bos_token_id is None:
            raise ValueError("the tokenizer has no bos token")
        self.bos = tokenizer.bos_token_id
        self.kinds = list(texts)
        self.tokens = {k: torch.tensor(tokenizer.encode(t, add_special_tokens=False), dtype=torch.int64)
                       for k, t in texts.items()}

    def num_tokens(self) -> dict[str, int]:
        return {k: int(t.numel()) for k, t in self.tokens.items()}

    def check_seq_len(self, seq_len: int) -> None:
        """Raise ValueError naming the first kind whose text is too short for ``seq_len``-token rows."""
        for kind, toks in self.tokens.items():
            _check_length(kind, toks, seq_len)

    def sample(self, gen: torch.Generator, batch: int, seq_len: int) -> tuple[torch.Tensor, list[str]]:
        """Returns ids [batch, seq_len + 1] int64 (column 0 is bos) and each row's kind.

        Inputs are ``ids[:, :-1]``, next-token targets ``ids[:, 1:]``.
        """
        rows, kinds = [], []
        start_kind = int(torch.randint(len(self.kinds), (1,), generator=gen))
        for r in range(batch):
            kind = self.kinds[(start_kind + r) % len(self.kinds)]
            toks = self.tokens[kind]
            _check_length(kind, toks, seq_len)
            off = int(torch.randint(toks.numel() - seq_len + 1, (1,), generator=gen))
            rows.append(torch.cat((torch.tensor([self.bos]), toks[off:off + seq_len])))
            kinds.append(kind)
        return torch.stack(rows), kinds


def _check_length(kind: str, toks: torch.Tensor, seq_len: int) -> None:
    if toks.numel() <= seq_len:
        raise ValueError(f"{kind} text has {toks.numel()} tokens, fewer than seq_len {seq_len}")
