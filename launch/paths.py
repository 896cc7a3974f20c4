"""Output paths checked before the work that fills them: a run that takes minutes must not find
out at its end that ``--json /tmp`` is a directory."""

from __future__ import annotations

import os
import tempfile
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
        return _writable_dir_problem(p)
    return _creatable(p.parent)


def _creatable(parent: Path) -> str | None:
    ancestor = parent.absolute()
    while not ancestor.exists():
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        return f"{ancestor} is not a directory"
    return _writable_dir_problem(ancestor)


def _writable_dir_problem(folder: Path) -> str | None:
    """Why no file can be made in the existing directory ``folder``, or None. os.access alone says yes
    to root wherever the mode bits would (/proc, a read-only bind mount), so a file is made there and
    removed again to be sure."""
    if not os.access(folder, os.W_OK | os.X_OK):
        return f"{folder} is not writable"
    try:
        fd, probe = tempfile.mkstemp(prefix=".moe-write-probe-", dir=folder)
    except OSError as e:
        return f"no file can be made in {folder} (making one failed: {(e.strerror or str(e)).lower()})"
    os.close(fd)
    os.unlink(probe)
    return None
