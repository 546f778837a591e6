"""Config files (`configs/<method>.py[:preset]`) and ConfigDict -> frozen dataclasses.

ConfigDict stops at the driver: `build(cls, config_dict)` turns it into the typed dataclasses the
library takes, rejecting unknown keys and wrong types with the dotted name of the field.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import os
import types
import typing
from collections.abc import Mapping, Sequence

import ml_collections

from posttrain.errors import UserError


class ConfigError(UserError, ValueError):
    """A config the user can fix; the message names the field and what to change."""


def load_config_file(spec: str) -> ml_collections.ConfigDict:
    """Loads `path/to/file.py[:preset]` by calling its `get_config(preset)`."""
    path, _, preset = spec.partition(":")
    if not os.path.isfile(path):
        raise ConfigError(f"config file {path!r} does not exist")
    module_spec = importlib.util.spec_from_file_location(
        f"_posttrain_config_{abs(hash(path))}", path
    )
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    if not hasattr(module, "get_config"):
        raise ConfigError(f"{path} has no get_config(preset) function")
    try:
        return module.get_config(preset) if preset else module.get_config()
    except (KeyError, ValueError) as e:  # e.g. an unknown preset: the file's own message
        raise ConfigError(f"{spec}: {e}") from None


def override(config, values: Mapping[str, typing.Any] | None):
    """Sets dotted keys (`{"train.steps": 50, "mesh.ici.data": -1}`) in a ConfigDict or dict,
    as `--config.train.steps=50` does on the command line; returns `config`."""
    for key, value in (values or {}).items():
        node = config
        *parents, leaf = key.split(".")
        for name in parents:
            node = node[name]
        node[leaf] = value
    return config


def to_plain(value):
    if isinstance(value, ml_collections.ConfigDict):
        return {k: to_plain(v) for k, v in value.items()}
    if isinstance(value, Mapping):
        return {k: to_plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [to_plain(v) for v in value]
    return value


def _convert(tp, value, where: str):
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _convert(arg, value, where)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[0] if errors else f"{where}: cannot be {value!r}")
    if dataclasses.is_dataclass(tp):
        if hasattr(tp, "from_config") and isinstance(value, Mapping):
            return tp.from_config(value, where)
        return build(tp, value, where)
    if origin in (tuple, list, Sequence) or tp in (tuple, list):
        if not isinstance(value, list | tuple):
            raise ConfigError(f"{where}: expected a list, got {value!r}")
        item_type = args[0] if args else typing.Any
        return tuple(_convert(item_type, v, f"{where}[{i}]") for i, v in enumerate(value))
    if origin is dict or tp is dict:
        if not isinstance(value, Mapping):
            raise ConfigError(f"{where}: expected a dict, got {value!r}")
        return dict(value)
    if tp is typing.Any:
        return value
    if tp is float and isinstance(value, int | float) and not isinstance(value, bool):
        if not math.isfinite(value):  # a NaN learning rate would train NaN weights
            raise ConfigError(f"{where}: {value!r} is not a finite number")
        return float(value)
    if tp is int and isinstance(value, int) and not isinstance(value, bool):
        return value
    if tp in (str, bool) and isinstance(value, tp):
        return value
    raise ConfigError(f"{where}: expected {getattr(tp, '__name__', tp)}, got {value!r}")


def _section_keys(field: dataclasses.Field) -> set[str]:
    """The keys of a field whose default is a section (a dataclass), else none."""
    default = field.default
    return (
        {f.name for f in dataclasses.fields(default)}
        if dataclasses.is_dataclass(default)
        else set()
    )


def _over_default(field: dataclasses.Field, value):
    """A section given in part keeps its field's default for the rest: `rollout.sampling` with
    only `top_p` set keeps the rollout's temperature 1.0, not `SamplingParams`' own 0.0."""
    default = field.default
    if not (dataclasses.is_dataclass(default) and isinstance(value, Mapping)):
        return value
    return {**dataclasses.asdict(default), **value}


def retired_key(cls, key: str) -> str | None:
    """What to set instead of the dotted `key` of `cls` where the section holding it retired
    it (its class's `RETIRED_KEYS`), else None."""
    *path, leaf = key.split(".")
    for name in path:
        tp = typing.get_type_hints(cls).get(name)
        # (a section that may be None, `LoRAConfig | None`, is its dataclass)
        cls = next((t for t in typing.get_args(tp) or (tp,) if dataclasses.is_dataclass(t)), None)
        if cls is None:
            return None
    return getattr(cls, "RETIRED_KEYS", {}).get(leaf)


def build(cls, config, where: str = "config"):
    """Builds the frozen dataclass `cls` from a ConfigDict / dict, recursively.

    Unknown keys are an error naming the key and the known ones (a key the class retired, in
    its `RETIRED_KEYS` {old key: what to set instead}, names what replaces it); missing keys
    take the dataclass defaults; `__post_init__` checks run as usual and are reported with `where`.
    """
    values = to_plain(config)
    if not isinstance(values, Mapping):
        raise ConfigError(f"{where}: expected a section of fields, got {values!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(values) - set(fields))
    retired = [k for k in unknown if k in getattr(cls, "RETIRED_KEYS", {})]
    if retired:
        raise ConfigError(
            f"{where} has no key {retired[0]!r} any more: {cls.RETIRED_KEYS[retired[0]]}"
        )
    if unknown:
        moved = [
            f"{where}.{f}.{k}" for k in unknown for f in fields if k in _section_keys(fields[f])
        ]
        hint = f" (did you mean {', '.join(moved)}?)" if moved else ""
        raise ConfigError(
            f"{where} has unknown key(s) {unknown}{hint}; known keys: {sorted(fields)}"
        )
    kwargs = {
        name: _convert(hints[name], _over_default(fields[name], values[name]), f"{where}.{name}")
        for name in fields
        if name in values
    }
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{where}: {e}") from None
