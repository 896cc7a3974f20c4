"""Default sampling parameters from a checkpoint's ``generation_config.json``, as vLLM's
``--generation-config`` takes them.

Model makers put the sampling they recommend there (Qwen3: ``temperature`` 0.6, ``top_p`` 0.95,
``top_k`` 20). vLLM, by default (``--generation-config auto``), uses those values for every request
field the request leaves out, and so does this runtime: the OpenAI server, ``LLM.generate`` /
``LLM.chat`` called without sampling params, and ``generate``'s input lines.

Only six keys are read, as vLLM reads them: ``repetition_penalty``, ``temperature``, ``top_k``,
``top_p``, ``min_p`` and ``max_new_tokens`` (which becomes ``max_tokens``: an upper bound on what a
request may ask for). ``do_sample`` and every other key are ignored; a key that is absent or null
sets nothing.

``generation_config``: ``"auto"`` (the model directory's file; none there: no defaults), ``"vllm"``
(no defaults: the engine's own), or a directory holding a ``generation_config.json``.
``override_generation_config`` (vLLM's ``--override-generation-config``) then sets or replaces
keys, with the same six names.

A value of the wrong type raises ``GenerationConfigError`` (a ``ValueError``), one line naming the
file (or the override) and the key; ranges are checked where the fields become ``SamplingParams``.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from launch.core.sampling_params import SamplingParams
from moe.json_object import read_json_object

log = logging.getLogger(__name__)

FILE_NAME = "generation_config.json"
MODES = ("auto", "vllm")
# generation_config.json key -> SamplingParams field (vLLM's list, in its order)
SAMPLING_KEYS = {"repetition_penalty": "repetition_penalty", "temperature": "temperature", "top_k": "top_k",
                 "top_p": "top_p", "min_p": "min_p", "max_new_tokens": "max_tokens"}
_INT_KEYS = ("top_k", "max_new_tokens")


class GenerationConfigError(ValueError):
    """A generation config that cannot give sampling defaults (the message is one line)."""


def generation_config_file(model_dir: str | Path, generation_config: str = "auto") -> Path | None:
    """The file whose sampling defaults apply: the model directory's for ``"auto"`` (None when it has
    none), None for ``"vllm"``, else ``generation_config`` as a directory, which must hold the file."""
    if generation_config == "vllm":
        return None
    if generation_config == "auto":
        path = Path(model_dir) / FILE_NAME
        return path if path.is_file() else None
    folder = Path(generation_config)
    if not folder.is_dir():
        raise GenerationConfigError(f"generation_config {generation_config!r} is not 'auto', 'vllm' or a directory")
    path = folder / FILE_NAME
    if not path.is_file():
        raise GenerationConfigError(f"generation_config directory {generation_config!r} has no {FILE_NAME}")
    return path


def default_sampling_fields(model_dir: str | Path, generation_config: str = "auto",
                            overrides: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The ``SamplingParams`` fields (``temperature``, ``top_p``, ``top_k``, ``min_p``,
    ``repetition_penalty``, ``max_tokens``) that requests take when they leave them out: the
    generation config's (see the module docstring), then ``overrides``."""
    path = generation_config_file(model_dir, generation_config)
    data: dict[str, Any] = {}
    if path is not None:
        raw = read_json_object(path, GenerationConfigError,
                               lambda e: f"{path}: not a readable JSON file ({str(e).splitlines()[0]})",
                               lambda raw: f"{path}: must hold a JSON object, found {type(raw).__name__}")
        data = {key: raw[key] for key in SAMPLING_KEYS if raw.get(key) is not None}
        _check_types(data, str(path))
    if overrides:
        data.update(check_overrides(overrides))
    return {SAMPLING_KEYS[key]: value for key, value in data.items()}


def check_overrides(overrides: Mapping[str, Any]) -> dict[str, Any]:
    """The keys ``overrides`` (``override_generation_config``) sets (its non-null ones);
    GenerationConfigError naming an unknown key or a value of the wrong type. Needs no file: the
    runtime config checks it when it is built (``launch.config.EngineConfig``)."""
    unknown = [key for key in overrides if key not in SAMPLING_KEYS]
    if unknown:
        raise GenerationConfigError(f"override_generation_config: unknown key {unknown[0]!r}; "
                                    f"known keys: {list(SAMPLING_KEYS)}")
    given = {key: value for key, value in overrides.items() if value is not None}
    _check_types(given, "override_generation_config")
    return given


def checked_sampling_defaults(model_dir: str | Path, generation_config: str = "auto",
                              overrides: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """``default_sampling_fields``, checked as ``SamplingParams`` checks them once the overrides
    replaced the file's values (as vLLM merges them: an override can replace a value of the file
    that requests could not take); ValueError naming the source (the file, or
    override_generation_config) and the field otherwise. What the engine starts with, and what
    ``config`` checks, so that every command refuses the same generation configs."""
    fields = default_sampling_fields(model_dir, generation_config, overrides)
    problem = _sampling_problem(fields)
    if problem is None:
        return fields
    overridden = {SAMPLING_KEYS[k] for k, v in (overrides or {}).items() if v is not None}
    kept = {k: v for k, v in fields.items() if k not in overridden}  # the file's values still in force
    file_problem = _sampling_problem(kept)  # the file is to blame when those fail on their own
    if file_problem is not None:
        raise GenerationConfigError(f"generation config {generation_config_file(model_dir, generation_config)}: "
                                    f"{file_problem}")
    raise GenerationConfigError(f"generation config override_generation_config: {problem}")


def _sampling_problem(fields: Mapping[str, Any]) -> str | None:
    """What ``SamplingParams(**fields)`` refuses, or None."""
    try:
        SamplingParams(**fields)
    except ValueError as err:
        return str(err)
    return None


def _check_types(data: Mapping[str, Any], where: str) -> None:
    for key, value in data.items():
        if key in _INT_KEYS:
            ok = isinstance(value, int) and not isinstance(value, bool)
            want = "an integer"
        else:
            ok = isinstance(value, int | float) and not isinstance(value, bool)
            want = "a number"
        if not ok:
            raise GenerationConfigError(f"{where}: {key} must be {want}, got {json.dumps(value)[:60]}")


def describe_defaults(fields: Mapping[str, Any]) -> str:
    """The startup line that names the defaults in force (empty when there are none)."""
    if not fields:
        return ""
    shown = ", ".join(f"{k}={v}" for k, v in fields.items())
    return (f"default sampling parameters from the model's generation config: {shown} (requests that set a "
            "field keep theirs; --generation-config vllm turns this off)")
