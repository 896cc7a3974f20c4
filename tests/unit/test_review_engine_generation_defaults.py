"""Review: --override-generation-config replaces the file's values before they are checked."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from launch.engine import sampling_defaults
from launch.llm import build_runtime_config


def _model(tmp_path: Path, **fields: object) -> Path:
    (tmp_path / "generation_config.json").write_text(json.dumps(fields))
    return tmp_path


def test_an_override_replaces_a_value_the_engine_would_refuse(tmp_path: Path) -> None:
    """vLLM merges the overrides into the file's keys and uses the result: an override is the way to
    serve a checkpoint whose generation_config.json holds a value requests cannot take."""
    model = _model(tmp_path, top_p=0.0, temperature=0.6)
    config = build_runtime_config(str(model), {"override_generation_config": {"top_p": 0.9}})
    assert sampling_defaults(config, model) == {"top_p": 0.9, "temperature": 0.6}


@pytest.mark.parametrize(("fields", "overrides", "source"), [
    ({"top_p": 0.0}, {}, "generation_config.json"),
    ({"top_p": 0.0}, {"temperature": 0.5}, "generation_config.json"),
    ({"top_p": 0.5}, {"repetition_penalty": 0.0}, "override_generation_config"),
])
def test_a_value_left_bad_names_its_source(tmp_path: Path, fields, overrides, source) -> None:
    model = _model(tmp_path, **fields)
    config = build_runtime_config(str(model), {"override_generation_config": overrides})
    with pytest.raises(ValueError, match=f"generation config .*{source}: "):
        sampling_defaults(config, model)


def test_a_bad_override_is_named_even_when_it_replaces_a_bad_file_value(tmp_path: Path) -> None:
    model = _model(tmp_path, top_p=0.0)
    config = build_runtime_config(str(model), {"override_generation_config": {"top_p": 1.5}})
    with pytest.raises(ValueError, match="override_generation_config: top_p must be in"):
        sampling_defaults(config, model)
