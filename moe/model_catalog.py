"""Released models by name, offline: the architecture numbers of their ``config.json``.

``configs/models/<name>.json`` holds each released model's public ``config.json`` (numbers
only, no weights) with its Hugging Face id in ``_name_or_path`` and other ids of the same
architecture in ``_aliases``. ``find_model_config`` resolves a name the way a user types
it: the Hugging Face id (``deepseek-ai/DeepSeek-V3``), the part after the slash
(``DeepSeek-V3``) or the file's short name (``deepseek-v3``), case-insensitively. Sizing
(``kvcalc``, ``simulate``, config validation) uses it; loading weights never does.
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path
from typing import Any

CATALOG_DIR = Path(__file__).resolve().parents[1] / "configs" / "models"


def _keys(name: str, raw: dict[str, Any]) -> set[str]:
    ids = [raw.get("_name_or_path") or name, *raw.get("_aliases", ())]
    keys = {name.lower()}
    for hf_id in ids:
        keys.add(hf_id.lower())
        keys.add(hf_id.rsplit("/", 1)[-1].lower())
    return keys


@lru_cache(maxsize=1)
def _catalog() -> dict[str, Path]:
    index: dict[str, Path] = {}
    for path in sorted(CATALOG_DIR.glob("*.json")):
        with open(path, encoding="utf-8") as f:
            raw = json.load(f)
        for key in _keys(path.stem, raw):
            index.setdefault(key, path)
    return index


def known_model_names() -> list[str]:
    """The Hugging Face ids of the shipped configs (one per file), sorted."""
    names = []
    for path in sorted(set(_catalog().values())):
        with open(path, encoding="utf-8") as f:
            names.append(json.load(f).get("_name_or_path") or path.stem)
    return sorted(names)


def find_model_config(name: str) -> dict[str, Any] | None:
    """The shipped ``config.json`` dict for ``name`` (HF id, its tail, or short name), or None."""
    path = _catalog().get(str(name).strip().lower())
    if path is None:
        return None
    with open(path, encoding="utf-8") as f:
        return json.load(f)
