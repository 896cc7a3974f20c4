"""Prompt workloads: shipped sets of clearly different kinds of text, or the user's own files.

A workload ``spec`` is one of

- a shipped name (``WORKLOAD_NAMES``): ``prose`` (English essays and stories), ``code``
  (Python and shell snippets), ``tables`` (numbers: CSV and Markdown tables, ledgers) and
  ``french`` (French prose). Each is ``launch/data/workloads/<name>.jsonl``;
- a file: ``.jsonl`` with one JSON object per line holding a non-empty string ``"prompt"`` or a
  non-empty list of token ids ``"prompt_token_ids"`` (ints >= 0: a checkpoint without a tokenizer
  runs those; other keys are ignored, except a ``generate`` line's sampling fields such as
  ``"max_tokens"``: the run's own flags set those, and a line that names one is an error naming the
  line), or ``.txt`` with one prompt per non-blank line;
- phases joined by ``+``: ``prose+code`` is every prose prompt, then every code prompt, so a
  run over it switches kind of text midway (expert load drifts with it).

``load_workload(spec)`` returns the prompts in order (``Prompt``: text, or a tuple of token ids);
``load_workload_phases(spec)`` keeps the phase boundaries; ``read_workload_file(path)`` reads one file. Every user mistake (unknown name, missing file, a file that is not UTF-8, bad
line, empty workload) raises ``WorkloadError`` (a ValueError) with a one-line message naming it.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from launch.core.sampling_params import SamplingParams
from launch.tokenizer import check_prompt

__all__ = ["WORKLOAD_DIR", "WORKLOAD_NAMES", "Prompt", "WorkloadError", "load_workload", "load_workload_phases",
           "read_workload_file"]

Prompt = str | tuple[int, ...]  # text, or token ids (a .jsonl line's "prompt_token_ids")

WORKLOAD_DIR = Path(__file__).resolve().parent / "data" / "workloads"
# The trained tiny DeepSeek-V3-style checkpoint shipped with the package (train-tiny --seed 0):
# the default model of `make run` and of `profile run`.
SHIPPED_MODEL = Path(__file__).resolve().parent / "data" / "models" / "tiny-dsv3"
WORKLOAD_NAMES: tuple[str, ...] = ("prose", "code", "tables", "french")
_FILE_SUFFIXES = (".jsonl", ".txt")


class WorkloadError(ValueError):
    """A workload spec that names nothing loadable, or a file with a malformed line."""


def read_text_file(path: Path) -> str:
    """The UTF-8 text of ``path`` (a leading byte-order mark dropped); WorkloadError naming the file
    when it is not UTF-8 or cannot be read."""
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise WorkloadError(f"{path}: cannot be read ({(e.strerror or str(e)).lower()})") from None
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = raw[: e.start].count(b"\n") + 1
        raise WorkloadError(f"{path}: not UTF-8 text (line {line})") from None


def jsonl_values(text: str, where: Callable[[int], str]) -> Iterator[tuple[int, Any]]:
    """(line number from 1, value) of each non-blank line of the JSONL ``text``; WorkloadError
    ``"{where(n)}: not JSON (...)"`` at the first line that is not JSON."""
    for n, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            value = json.loads(line)
        except json.JSONDecodeError as e:
            raise WorkloadError(f"{where(n)}: not JSON ({e.msg})") from None
        yield n, value


# Fields of a ``generate`` input line that a workload line must not carry: the run's flags set them.
_SAMPLING_FIELDS = frozenset(f.name for f in dataclasses.fields(SamplingParams))


def check_workload_row(row: Any, where: str) -> Prompt:
    """The prompt of one ``.jsonl`` workload line: its text, or its token ids as a tuple; WorkloadError
    naming ``where`` (file:line) unless ``row`` is an object with a non-empty string ``"prompt"`` or a
    non-empty list of token ids >= 0 ``"prompt_token_ids"`` (one of the two), and no sampling field
    (``max_tokens``, ``temperature``, ...: a ``generate`` line's, which a workload would silently not
    apply; the command's own flags set them). Other keys (``"id"``, a dataset's metadata) are ignored.
    Token ids are checked against a model's vocabulary where one is known (``launch.sweep.workload``)."""
    if not isinstance(row, dict) or (("prompt" in row) == ("prompt_token_ids" in row)):
        raise WorkloadError(f"{where}: expected an object with a string \"prompt\" or a list of token ids "
                            "\"prompt_token_ids\" (one of the two)")
    sampling = sorted(set(row) & _SAMPLING_FIELDS)
    if sampling:
        raise WorkloadError(f"{where}: sampling field(s) {sampling} in a workload line: a workload sets only "
                            "prompts; the command's flags (--max-tokens, ...) set sampling")
    key = "prompt" if "prompt" in row else "prompt_token_ids"
    try:  # the generate lines' and the server's check of either field
        check_prompt({key: row[key]}, where)
    except WorkloadError:
        raise
    except (TypeError, ValueError) as e:
        message = str(e)
        raise WorkloadError(message if message.startswith(f"{where}:") else f"{where}: {message}") from None
    return row["prompt"] if key == "prompt" else tuple(row["prompt_token_ids"])


def _read_jsonl(path: Path) -> list[Prompt]:
    return [check_workload_row(row, f"{path}:{n}")
            for n, row in jsonl_values(read_text_file(path), lambda n: f"{path}:{n}")]


def read_workload_file(path: Path) -> list[Prompt]:
    """The prompts of one ``.jsonl`` / ``.txt`` workload file, in order; WorkloadError naming the file
    (and line) for a missing file, another suffix, a bad line or no prompts."""
    if path.is_dir():
        raise WorkloadError(f"workload {path} is a directory: give a .jsonl or .txt file, or a shipped workload name")
    if not path.is_file():
        raise WorkloadError(f"workload file {path} not found")
    if path.suffix == ".jsonl":
        prompts = _read_jsonl(path)
    elif path.suffix == ".txt":
        prompts = [line for line in read_text_file(path).splitlines() if line.strip()]
    else:
        raise WorkloadError(f"workload file {path}: expected a .jsonl or .txt file")
    if not prompts:
        raise WorkloadError(f"workload file {path} holds no prompts")
    return prompts


def _load_one(spec: str) -> list[Prompt]:
    if spec in WORKLOAD_NAMES:
        return read_workload_file(WORKLOAD_DIR / f"{spec}.jsonl")
    path = Path(spec).expanduser()
    if path.suffix in _FILE_SUFFIXES or path.exists() or "/" in spec:
        return read_workload_file(path)
    raise WorkloadError(f"unknown workload {spec!r}; expected one of {', '.join(WORKLOAD_NAMES)}, "
                        "a .jsonl/.txt file, or phases joined by '+'")


def load_workload_phases(spec: str) -> list[tuple[str, list[Prompt]]]:
    """``[(phase spec, prompts)]`` in order: one entry per ``+``-separated part of ``spec``.

    A spec that is itself an existing file is one phase even if its name holds a ``+``.
    """
    if not isinstance(spec, str) or not spec.strip():
        raise WorkloadError("empty workload spec; expected a name, a file, or phases joined by '+'")
    spec = spec.strip()
    if "+" in spec and not Path(spec).expanduser().is_file():
        parts = [p.strip() for p in spec.split("+")]
        if any(not p for p in parts):
            raise WorkloadError(f"workload {spec!r} has an empty phase")
    else:
        parts = [spec]
    return [(part, _load_one(part)) for part in parts]


def load_workload(spec: str) -> list[Prompt]:
    """The prompts of ``spec`` (a shipped name, a .jsonl/.txt file, or phases joined by '+'), in order."""
    return [p for _, prompts in load_workload_phases(spec) for p in prompts]
