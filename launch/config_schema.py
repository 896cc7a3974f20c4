"""Strict loading of nested frozen dataclasses from plain data (parsed YAML, JSON, flags).

``build_dataclass(cls, data)`` walks ``data`` along ``cls``'s fields: nested dataclass
fields take mappings, the rest are type-checked against their annotations (``int``,
``float``, ``bool``, ``str``, ``dict``, ``Any`` and unions of these; ``None`` only where the
annotation allows it; an int is accepted for a float; ``1e-3``, which YAML 1.1 reads as
a string, is accepted for a float). Every error is a ``ConfigError`` naming the full
dotted key; an unknown key also names the closest valid key. A field whose metadata is
``PATH`` (``field(metadata=PATH)``) holds a filesystem path: a leading ``~`` / ``~user`` is
expanded to the home directory, so a YAML file, ``--set`` and a flag all read ``~/ckpt`` alike
(YAML reads a bare ``~`` as null, which the type check then refuses).
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import re
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

_SCI_FLOAT = re.compile(r"^[+-]?(\d+\.?\d*|\.\d+)[eE][+-]?\d+$")
PATH: Mapping[str, Any] = types.MappingProxyType({"path": True})  # field metadata: a filesystem path
_TYPE_NAMES = {int: "int", float: "float", bool: "bool", str: "str", dict: "mapping", type(None): "null"}


class ConfigError(ValueError):
    """A configuration value, key or file that cannot be used; the message names the key."""


def _type_name(tp: Any) -> str:
    args = typing.get_args(tp)
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in args)
    origin = typing.get_origin(tp) or tp
    return _TYPE_NAMES.get(origin, getattr(origin, "__name__", str(origin)))


def _matches(value: Any, tp: Any) -> tuple[bool, Any]:
    """(ok, converted value) for one non-union annotation."""
    if tp is Any:
        return True, value
    origin = typing.get_origin(tp) or tp
    if origin is type(None):
        return value is None, value
    if origin is bool:
        return isinstance(value, bool), value
    if origin is int:
        return isinstance(value, int) and not isinstance(value, bool), value
    if origin is float:
        if isinstance(value, str) and _SCI_FLOAT.match(value.strip()):
            return True, float(value)
        ok = isinstance(value, int | float) and not isinstance(value, bool)
        return ok, float(value) if ok else value
    if origin is str:
        return isinstance(value, str), value
    if origin is dict:
        ok = isinstance(value, Mapping) and all(isinstance(k, str) for k in value)
        return ok, dict(value) if ok else value
    raise TypeError(f"config schema: unsupported annotation {tp!r}")


def check_value(value: Any, tp: Any, key: str) -> Any:
    """``value`` converted to annotation ``tp``, or ConfigError naming ``key``."""
    arms = typing.get_args(tp) if typing.get_origin(tp) in (typing.Union, types.UnionType) else (tp,)
    for arm in arms:
        ok, converted = _matches(value, arm)
        if ok:
            return converted
    raise ConfigError(f"{key}: expected {_type_name(tp)}, found {type(value).__name__} {value!r}")


def dotted_keys(cls: type, prefix: str = "") -> list[str]:
    """Every valid dotted key of dataclass ``cls`` (leaves and nested sections)."""
    out = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        key = f"{prefix}{f.name}"
        out.append(key)
        if dataclasses.is_dataclass(hints[f.name]):
            out.extend(dotted_keys(hints[f.name], key + "."))
    return out


def suggest_key(key: str, siblings: list[str], root: type | None) -> str:
    """' (did you mean X?)' for an unknown dotted ``key``, or ''."""
    leaf = key.rsplit(".", 1)[-1]
    close = difflib.get_close_matches(leaf, siblings, n=1, cutoff=0.6)
    if close:
        parent = key.rsplit(".", 1)[0] + "." if "." in key else ""
        return f" (did you mean '{parent}{close[0]}'?)"
    if root is not None:
        candidates = {k.rsplit(".", 1)[-1]: k for k in dotted_keys(root)}
        close = difflib.get_close_matches(leaf, list(candidates), n=1, cutoff=0.75)
        if close:
            return f" (did you mean '{candidates[close[0]]}'?)"
    return ""


def build_dataclass(cls: type, data: Any, prefix: str = "", root: type | None = None) -> Any:
    """Instance of dataclass ``cls`` from mapping ``data``; strict (see module doc)."""
    root = root or cls
    where = prefix or "config"
    if not isinstance(data, Mapping):
        raise ConfigError(f"{where}: expected a mapping, found {type(data).__name__} {data!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for key in data:
        if key not in fields:
            dotted = f"{prefix}.{key}" if prefix else str(key)
            raise ConfigError(f"unknown config key '{dotted}'{suggest_key(dotted, list(fields), root)}; "
                              f"valid keys{' of ' + prefix if prefix else ''}: {sorted(fields)}")
    for name, f in fields.items():
        no_default = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        if no_default and name not in data:
            raise ConfigError(f"missing required config key '{prefix + '.' if prefix else ''}{name}'")
    kwargs = {}
    for name, value in data.items():
        dotted = f"{prefix}.{name}" if prefix else name
        tp = hints[name]
        if dataclasses.is_dataclass(tp):
            kwargs[name] = build_dataclass(tp, {} if value is None else value, dotted, root)
        else:
            kwargs[name] = check_value(value, tp, dotted)
            if fields[name].metadata.get("path") and isinstance(kwargs[name], str):
                kwargs[name] = os.path.expanduser(kwargs[name])
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as e:
        if isinstance(e, ConfigError):
            raise
        raise ConfigError(f"{where}: {e}") from e


class _StrictLoader(yaml.SafeLoader):
    """YAML's safe loader, refusing a key given twice in one mapping (PyYAML keeps the last)."""


def _construct_unique_mapping(loader: _StrictLoader, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
    seen: set[Any] = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if key in seen:
            raise yaml.constructor.ConstructorError(None, None, f"key {key!r} is given twice", key_node.start_mark)
        seen.add(key)
    return loader.construct_mapping(node, deep=deep)


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_unique_mapping)


def yaml_error_line(e: yaml.YAMLError) -> str:
    """A PyYAML error as one line: ``LINE:COL: problem (context)`` where it has a position, else its
    first line."""
    where, problem = _yaml_error_parts(e)
    return f"{where}: {problem}" if where else problem


def _yaml_error_parts(e: yaml.YAMLError) -> tuple[str, str]:
    if isinstance(e, yaml.MarkedYAMLError) and e.problem_mark is not None:
        mark = e.problem_mark
        context = f" ({e.context})" if e.context else ""
        return f"{mark.line + 1}:{mark.column + 1}", f"{e.problem}{context}"
    text = str(e).strip()
    return "", text.splitlines()[0] if text else type(e).__name__


def load_yaml_text(text: str, where: str) -> Any:
    """Parse ``text`` as YAML (safe, a key given twice refused); ConfigError
    ``WHERE:LINE:COL: invalid YAML: problem``."""
    try:
        return yaml.load(text, Loader=_StrictLoader)  # noqa: S506 (a SafeLoader subclass)
    except yaml.YAMLError as e:
        pos, problem = _yaml_error_parts(e)
        raise ConfigError(f"{where}{':' + pos if pos else ''}: invalid YAML: {problem}") from None


def load_yaml_mapping(path: str | Path) -> dict[str, Any]:
    """The top-level mapping of a YAML file; ConfigError naming the file otherwise."""
    p = Path(path)
    if p.is_dir():
        raise ConfigError(f"config file {p} is a directory, not a YAML file")
    if not p.exists():  # a pipe (/dev/stdin, <(...)) is read like a file
        raise ConfigError(f"config file {p} does not exist")
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"config file {p}: cannot be read: {e}") from None
    data = load_yaml_text(text, str(p))
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {p}: top level must be a mapping, found {type(data).__name__}")
    return data


def set_dotted(data: dict[str, Any], key: str, value: Any) -> None:
    """``data[a][b][c] = value`` for key "a.b.c", creating (or copying) sub-mappings."""
    parts = key.split(".")
    if not all(parts):
        raise ConfigError(f"malformed config key {key!r}")
    node = data
    for i, part in enumerate(parts[:-1]):
        child = node.get(part)
        if child is None:
            child = {}
        elif not isinstance(child, Mapping):
            raise ConfigError(f"cannot set '{key}': '{'.'.join(parts[: i + 1])}' is not a section")
        node[part] = child = dict(child)
        node = child
    node[parts[-1]] = value


def apply_override(data: dict[str, Any], item: str) -> None:
    """Apply one ``key.sub=value`` override (value parsed as YAML: 4, true, null, [1, 2])."""
    key, sep, raw = item.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"--set expects key.sub=value, got {item!r}")
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError as e:
        raise ConfigError(f"--set {key}: value {raw!r} is not valid YAML: {yaml_error_line(e)}") from None
    set_dotted(data, key.strip(), value)
