"""One value from TOML or the command line typed as its key's type, a table key's as its
dataclass, in its range and form; or a one-line `ConfigError` that names the key and, for a
misspelling, the closest valid one."""

from __future__ import annotations

import dataclasses
import difflib
import math
import types
import typing
from typing import Any, Literal

from hp_data.phases import PhaseError

from hp_runtime.model.config import FieldError
from hp_runtime.train.config.messages import _name, _shown
from hp_runtime.train.config.ranges import FORMS, RANGES
from hp_runtime.train.config.schema import KEYS, _key_types, as_table, key_fields, key_of
from hp_runtime.train.errors import ConfigError


def _similarity(wrong: str, right: str) -> float:
    """Closeness of two key names: whole-string likeness or the words they share
    (`lr_warmup` is nearer `warmup_steps` than `lr` is)."""
    ratio = difflib.SequenceMatcher(None, wrong, right).ratio()
    shared = set(wrong.split("_")) & set(right.split("_"))
    words = 2 * sum(len(word) for word in shared) / (len(wrong) + len(right))
    return max(ratio, words)


def suggest(section: str, key: str | None) -> str | None:
    """The closest valid dotted key (or section, when `key` is None), if any is close; a key
    of the same section wins a near tie."""
    if key is None:
        scored = [(_similarity(section, name), name) for name in KEYS]
    else:
        scored = [
            (_similarity(key, name) + (0.05 if other == section else 0.0), f"{other}.{name}")
            for other, names in KEYS.items()
            for name in names
        ]
    score, best = max(scored)
    return best if score >= 0.5 else None


def _unknown(section: str, key: str | None) -> ConfigError:
    where = _name(section if key is None else f"{section}.{key}")
    kind = "section" if key is None else "key"
    hint = suggest(section, key)
    return ConfigError(f"{where}: unknown {kind}" + (f"; did you mean {hint}?" if hint else ""))


def _table_class(kind: Any) -> type | None:
    """The dataclass a table key (`model.rope_scaling`) takes, if `kind` is one, alone or
    with none."""
    options = (
        typing.get_args(kind)
        if typing.get_origin(kind) in (typing.Union, types.UnionType)
        else (kind,)
    )
    return next((o for o in options if dataclasses.is_dataclass(o)), None)


def _type_name(kind: Any) -> str:
    if dataclasses.is_dataclass(kind):
        names = ", ".join(_key_types(kind))
        listed = f" or a list [{names}]" if getattr(kind, "as_list", False) else ""
        return "a table {" + names + "}" + listed
    origin = typing.get_origin(kind)
    if origin is tuple and dataclasses.is_dataclass(typing.get_args(kind)[0]):
        return "an array of tables {" + ", ".join(_key_types(typing.get_args(kind)[0])) + "}"
    if origin is Literal:
        return "one of " + ", ".join(repr(v) for v in typing.get_args(kind))
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(kind))
    if origin is tuple and typing.get_args(kind)[1:] == (Ellipsis,):
        return f"a list of {_plural(_type_name(typing.get_args(kind)[0]))}"
    if origin is tuple:
        parts = typing.get_args(kind)
        return f"a list of {len(parts)} (" + ", ".join(map(_type_name, parts)) + ")"
    names = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}
    return names.get(kind, "nothing") if kind is not type(None) else "none"


def _plural(name: str) -> str:
    """ "a string" -> "strings"."""
    return name.removeprefix("a ").removeprefix("an ") + "s"


def _coerce(value: Any, kind: Any) -> Any:
    """`value` (from TOML) as `kind`, or raise TypeError."""
    origin = typing.get_origin(kind)
    if origin in (typing.Union, types.UnionType):
        for option in typing.get_args(kind):
            if option is type(None):
                if value is None:
                    return None
                continue
            try:
                return _coerce(value, option)
            except TypeError:
                pass
        raise TypeError
    if origin is Literal:
        if value in typing.get_args(kind):
            return value
        raise TypeError
    if origin is tuple and typing.get_args(kind)[1:] == (Ellipsis,):  # a list of any length
        if isinstance(value, list | tuple):
            return tuple(_coerce(v, typing.get_args(kind)[0]) for v in value)
        raise TypeError
    if origin is tuple:  # a fixed-length list: `metrics.profile_steps = [10, 3]`
        parts = typing.get_args(kind)
        if isinstance(value, list | tuple) and len(value) == len(parts):
            return tuple(_coerce(v, part) for v, part in zip(value, parts, strict=True))
        raise TypeError
    if kind is bool:
        if isinstance(value, bool):
            return value
        raise TypeError
    if kind is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise TypeError
    if kind is float:
        if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
            return float(value)
        raise TypeError
    if kind is str:
        if isinstance(value, str):
            return value
        raise TypeError
    raise TypeError


def _fields_of(cls: type, value: Any) -> dict[str, Any] | None:
    """A table key's value as its fields by name: a table, the list a key that takes one
    (`train.batch_ramp = [start, increment, samples]`) gives, or a preset's dataclass; None
    for any other value."""
    if isinstance(value, cls):
        return as_table(value)
    if getattr(cls, "as_list", False) and isinstance(value, list | tuple):
        names = list(_key_types(cls))
        return dict(zip(names, value, strict=True)) if len(value) == len(names) else None
    return dict(value) if isinstance(value, dict) else None


def _value(key: str, kind: Any, value: Any) -> Any:
    """One key's value (from TOML) as `kind`, in its range and form."""
    table = _table_class(kind)
    fields_given = None if table is None else _fields_of(table, value)
    if fields_given is not None:
        return _table(key, table, fields_given)
    if typing.get_origin(kind) is tuple and dataclasses.is_dataclass(typing.get_args(kind)[0]):
        # an array of tables ([[data.phases]])
        if not isinstance(value, list | tuple) or not all(isinstance(v, dict) for v in value):
            raise ConfigError(f"{key}: expected {_type_name(kind)}, got {_shown(value)}")
        item = typing.get_args(kind)[0]
        return tuple(_table(f"{key}[{i}]", item, v) for i, v in enumerate(value))
    if table is not None and value == "none":  # TOML has no null: a preset's table unset
        value = None
    try:
        typed = _coerce(value, kind)
    except TypeError:
        raise ConfigError(f"{key}: expected {_type_name(kind)}, got {_shown(value)}") from None
    allowed = RANGES.get(key)
    if allowed is not None and typed is not None and typed not in allowed:
        raise ConfigError(f"{key}: must be {allowed}, got {typed}")
    form = FORMS.get(key)
    if form is not None and typed is not None:
        form(typed)
    return typed


def _unknown_field(key: str, name: str, kinds: dict[str, Any]) -> ConfigError:
    """`name` is no field of the table key `key`: the closest, if any is close, and all."""
    close = difflib.get_close_matches(name, kinds, n=1)
    hint = f"did you mean {key}.{close[0]}? " if close else ""
    return ConfigError(
        f"{_name(f'{key}.{name}')}: unknown field; {hint}its fields: {', '.join(kinds)}"
    )


def _table(key: str, cls: type, values: dict[str, Any]) -> Any:
    """A table key (`model.rope_scaling = {type = "llama3", ...}`) as the frozen dataclass
    `cls`: only its fields, every one without a default given, each typed as `_value` types
    a key; then the class's own check, whose `FieldError` names the field."""
    kinds = _key_types(cls)
    for name in values:
        if name not in kinds:
            raise _unknown_field(key, name, kinds)
    required = [key_of(f) for f in key_fields(cls) if f.default is dataclasses.MISSING]
    for name in required:
        if name not in values:
            needs = f"gives all of {', '.join(kinds)}"
            if len(required) < len(kinds):
                needs = f"needs {', '.join(required)} (the other fields have defaults)"
            raise ConfigError(f"{key}.{name}: required; {key} {needs}")
    typed = {name: _value(f"{key}.{name}", kinds[name], value) for name, value in values.items()}
    try:
        return cls(**{f.name: typed[key_of(f)] for f in key_fields(cls) if key_of(f) in typed})
    except (FieldError, PhaseError) as exc:
        if exc.value is None and exc.field not in values:  # required only with some values
            raise ConfigError(f"{key}.{exc.field}: {exc.problem}") from None
        raise ConfigError(f"{key}.{exc.field}: {exc.problem}, got {exc.value!r}") from None
