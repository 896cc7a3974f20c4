"""Output paths checked before the work that fills them: a run that takes minutes must not find
out at its end that ``--json /tmp`` is a directory."""

from __future__ import annotations

import os
from pathlib import Path


def output_file_problem(path: str | os.PathLike[str]) -> str | None:
    """Why ``path`` cannot be written as a file (the reason, naming the path), or None when it can:
    not empty, not a directory, its nearest existing ancestor a writable directory (missing parents
    are made when it is written), an existing file writable."""
    if not os.fspath(path):
        return "an empty path"
    p = Path(path)
    if p.is_dir():
        return f"{p} is a directory"
    if p.exists():
        return None if os.access(p, os.W_OK) else f"{p} is not writable"
    return _creatable(p.parent)


def write_output_file(path: str | os.PathLike[str], text: str) -> Path:
    """Write ``text`` to ``path``, making the missing parents ``output_file_problem`` accepted. Returns
    the path."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(text)
    return p


def output_dir_problem(path: str | os.PathLike[str]) -> str | None:
    """Why ``path`` cannot be used as an output directory (the reason, naming it), or None: not empty,
    a writable directory or creatable under one."""
    if not os.fspath(path):
        return "an empty path"
    p = Path(path)
    if p.exists() and not p.is_dir():
        return f"{p} exists and is not a directory"
    if p.is_dir():
        return None if os.access(p, os.W_OK | os.X_OK) else f"{p} is not writable"
    return _creatable(p.parent)


def _creatable(parent: Path) -> str | None:
    ancestor = parent.absolute()
    while not ancestor.exists():
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        return f"{ancestor} is not a directory"
    if not os.access(ancestor, os.W_OK | os.X_OK):
        return f"{ancestor} is not writable"
    return None
