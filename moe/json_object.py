"""JSON objects read from text or files, the failures raised as each caller's own error type and message.

Every caller has its own error class and wording (tests pin them), so both come in: ``error`` is the
exception class, and the message callbacks get what went wrong (the decode error, the value found).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any


def parse_json_object(text: str, error: Callable[[str], Exception], not_json: Callable[[ValueError], str],
                      not_object: Callable[[Any], str]) -> dict[str, Any]:
    """The JSON object in ``text``. Raises ``error(not_json(e))`` when ``text`` is not JSON and
    ``error(not_object(value))`` when its top level is another value (a list, a string, ...)."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise error(not_json(e)) from None
    if not isinstance(data, dict):
        raise error(not_object(data))
    return data


def read_json_object(path: str | os.PathLike[str], error: Callable[[str], Exception],
                     unreadable: Callable[[Exception], str], not_object: Callable[[Any], str]) -> dict[str, Any]:
    """The JSON object in the UTF-8 file ``path``. Raises ``error(unreadable(e))`` when it cannot be
    read, is not UTF-8 or is not JSON, and ``error(not_object(value))`` as ``parse_json_object``."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise error(unreadable(e)) from None
    return parse_json_object(text, error, unreadable, not_object)
