"""Sweep grids: ``key=[v1,v2]`` items -> the cross product of settings, each with a stable key.

A grid item is a dotted runtime-config key (the ``--set`` spelling) and a YAML list of
values: ``parallel.data_parallel_size=[1,2]``, ``balancer.num_redundant_experts=[0, 2]``,
``moe.capacity_factor=[0, 1.25]``. A scalar (``engine.max_num_seqs=8``) is a one-value
list. Points are the cross product in the order the items were given (the last item
varies fastest). A point's ``key`` is its settings as canonical JSON, so a rerun finds
finished points whatever order the grid items come in.

Keys joined by commas move together (a zipped axis), each value a list with one entry per
key: ``parallel.tensor_parallel_size,parallel.data_parallel_size=[[1,1],[1,2],[2,1]]``
sweeps three layouts, not the nine of a cross product.

Every value is type-checked against the runtime config schema when the item is parsed
(``engine.max_num_seqs=[abc,4]`` is an error naming the key and the value); whether a
combination of values is valid is only known per point (``point_config``).
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import json
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import yaml

from launch.config import RuntimeConfig
from launch.config_schema import (
    ConfigError,
    check_value,
    dotted_keys,
    set_dotted,
    suggest_key,
    yaml_error_line,
)


@dataclass(frozen=True)
class GridAxis:
    """Swept keys (one, or several zipped) and their values in the order given: for one key
    ``values[i]`` is a scalar, for zipped keys a tuple with one entry per key."""

    keys: tuple[str, ...]
    values: tuple[Any, ...]

    @property
    def key(self) -> str:
        return ",".join(self.keys)

    def settings(self, value: Any) -> dict[str, Any]:
        return dict(zip(self.keys, value)) if len(self.keys) > 1 else {self.keys[0]: value}


def _leaf_keys() -> list[str]:
    all_keys = dotted_keys(RuntimeConfig)
    return [k for k in all_keys if not any(other.startswith(k + ".") for other in all_keys)]


def _section_hint(key: str, leaves: Sequence[str]) -> str | None:
    """'is a section' message for a key naming a config section (``engine``), or None."""
    children = [x for x in leaves if x.startswith(key + ".")]
    if not children:
        return None
    examples = ", ".join(children[:2]) + (f" or {children[2]}" if len(children) > 2 else "")
    return f"--grid: '{key}' is a section, not a setting: give one of its keys such as {examples}"


def _annotation(key: str) -> Any:
    """The schema annotation of dotted ``key`` (a leaf of RuntimeConfig); Any under a mapping
    field (``model_overrides.*``)."""
    cls: Any = RuntimeConfig
    for part in key.split("."):
        if not dataclasses.is_dataclass(cls):
            return Any
        cls = typing.get_type_hints(cls)[part]
    return cls


def parse_grid_item(item: str) -> GridAxis:
    """``key=[v1, v2]`` (values parsed as YAML) -> GridAxis; ConfigError naming the key otherwise."""
    key, sep, raw = item.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ConfigError(f"--grid expects key=[v1,v2,...], got {item!r}")
    keys = tuple(k.strip() for k in key.split(","))
    leaves = _leaf_keys()
    for k in keys:
        if k not in leaves and not k.startswith("model_overrides."):
            section = _section_hint(k, leaves)
            if section:
                raise ConfigError(section)
            siblings = [x.rsplit(".", 1)[-1] for x in leaves if x.rsplit(".", 1)[0] == k.rsplit(".", 1)[0]]
            raise ConfigError(f"--grid: unknown config key '{k}'{suggest_key(k, siblings, RuntimeConfig)}")
    try:
        values = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError as e:
        raise ConfigError(f"--grid {key}: {raw!r} is not a YAML list: {yaml_error_line(e)}") from None
    if not isinstance(values, list):
        if len(keys) == 1 and isinstance(values, str) and "," in values and raw.strip()[:1] not in "'\"":
            raise ConfigError(f"--grid {key}: {values!r} is one value; a list needs brackets: {key}=[{raw.strip()}]")
        values = [values]
    if not values:
        raise ConfigError(f"--grid {key}: the value list is empty")
    if len(keys) > 1:
        if any(not isinstance(v, list) or len(v) != len(keys) for v in values):
            raise ConfigError(f"--grid {key}: each value must be a list of {len(keys)} (one per key), got {raw!r}")
        values = [tuple(v) for v in values]
    flat = [x for v in values for x in (v if len(keys) > 1 else (v,))]
    if any(isinstance(x, dict | list) for x in flat):
        raise ConfigError(f"--grid {key}: values must be scalars, got {raw!r}")
    if len({json.dumps(v) for v in values}) != len(values):
        raise ConfigError(f"--grid {key}: repeated value in {raw!r}")
    for value in values:
        for k, x in zip(keys, value if len(keys) > 1 else (value,)):
            try:
                check_value(x, _annotation(k), k)  # the strict loader's own check for this key's type
            except ConfigError as e:
                raise ConfigError(f"--grid {e}") from None
    return GridAxis(keys, tuple(values))


def parse_grid(items: Sequence[str]) -> list[GridAxis]:
    """Every ``--grid`` item; a key given twice is an error naming it."""
    axes = [parse_grid_item(item) for item in items]
    seen: set[str] = set()
    for axis in axes:
        for key in axis.keys:
            if key in seen:
                raise ConfigError(f"--grid: key '{key}' is given twice")
            seen.add(key)
    return axes


def expand_grid(axes: Sequence[GridAxis]) -> list[dict[str, Any]]:
    """The cross product: one settings dict (key -> value) per point; [{}] for no axes."""
    points = []
    for combo in itertools.product(*(a.values for a in axes)):
        settings: dict[str, Any] = {}
        for axis, value in zip(axes, combo):
            settings.update(axis.settings(value))
        points.append(settings)
    return points


def point_key(settings: Mapping[str, Any]) -> str:
    """Canonical JSON of a point's settings: equal for equal settings in any order."""
    return json.dumps(dict(settings), sort_keys=True, separators=(",", ":"))


def point_config(base: Mapping[str, Any], settings: Mapping[str, Any]) -> RuntimeConfig:
    """The base config (parsed YAML) with the point's settings applied; ConfigError or
    ValueError (with the offending key or numbers) when the combination is invalid."""
    data = copy.deepcopy(dict(base))
    for key, value in settings.items():
        set_dotted(data, key, value)
    return RuntimeConfig.from_dict(data)


def format_settings(settings: Mapping[str, Any]) -> str:
    """``dp=2 redundant=0`` style label: each key's last part, shortened."""
    return " ".join(f"{_SHORT.get(k.rsplit('.', 1)[-1], k.rsplit('.', 1)[-1])}={_fmt(v)}"
                    for k, v in settings.items()) or "base"


_SHORT = {
    "tensor_parallel_size": "tp", "data_parallel_size": "dp", "enable_expert_parallel": "ep",
    "num_redundant_experts": "redundant", "enable_eplb": "eplb", "capacity_factor": "cf",
    "max_num_seqs": "seqs", "max_num_batched_tokens": "batched", "enable_cpu_pinning": "pin",
}


def _fmt(value: Any) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    return str(value)
