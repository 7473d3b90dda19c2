"""A `Config` from a TOML file and dotted overrides (SECTION.KEY=VALUE, TABLE.FIELD of a table
key too): read, merged over the file and the model preset, typed (`values.py`) and checked
(`checks.py`) before any rank does work."""

from __future__ import annotations

import dataclasses
import tomllib
import typing
from dataclasses import dataclass
from typing import Any

from hp_data.errors import HpDataError

from hp_runtime.model.config import ModelConfig
from hp_runtime.model.presets import PRESETS
from hp_runtime.train.config.checks import check
from hp_runtime.train.config.messages import _name, _reason, _shown
from hp_runtime.train.config.schema import KEYS, SECTIONS, Config, _key_types, key_fields, key_of
from hp_runtime.train.config.values import (
    _fields_of,
    _table_class,
    _unknown,
    _unknown_field,
    _value,
    suggest,
)
from hp_runtime.train.errors import ConfigError


def _takes_str(kind: Any) -> bool:
    if kind is str:
        return True
    args = typing.get_args(kind)
    return any(isinstance(a, str) for a in args) or any(_takes_str(a) for a in args)


def _parse_override(text: str, kind: Any) -> Any:
    """A command-line value as TOML reads it (`50`, `3e-4`, `true`), except that a key taking
    text keeps the text as given (`data.split=969,30,1`, `train.run_dir=out/a`)."""
    args = typing.get_args(kind)
    if text.lower() in ("none", "null") and type(None) in args:
        return None
    try:
        value = tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text
    if isinstance(value, list) and _takes_list(kind):  # `train.float8.skip=["wo"]`
        return value
    if _takes_str(kind) and not isinstance(value, str):
        return text
    return value


def _takes_list(kind: Any) -> bool:
    return typing.get_origin(kind) is tuple or any(map(_takes_list, typing.get_args(kind)))


@dataclass(frozen=True)
class Fields:
    """Fields of a table key set by dotted overrides (`model.moe.top_k=1`) where the config
    gives the key no value: they update the preset's table, which is known only once every
    key is read (`model.preset` may come later, or from the file)."""

    values: dict[str, Any]


def _updated(current: Any, cls: type, fields: dict[str, Any]) -> Any:
    """A table key's value with `fields` set, as TOML's dotted keys set them: into the table
    it holds; into the preset's (`Fields`) where the config gives none; into a new table over
    any other value (none): then checked whole, so a required field may be missing."""
    if isinstance(current, Fields):
        return Fields({**current.values, **fields})
    return {**(_fields_of(cls, current) or {}), **fields}


def _field_override(section: str, name: str, text: str) -> tuple[str, type, Any] | None:
    """(table key, its class, the field's value) when `name` is `TABLE.FIELD` of a table key
    of `section` (`moe.top_k`); None for any other key."""
    table, _, field = name.partition(".")
    cls = _table_class(KEYS[section].get(table)) if field else None
    if cls is None:
        return None
    kinds = _key_types(cls)
    if field not in kinds:
        raise _unknown_field(f"{section}.{table}", field, kinds)
    return table, cls, {field: _parse_override(text, kinds[field])}


def parse_overrides(items: list[str]) -> dict[str, dict[str, Any]]:
    """`["train.steps=50", "optim.lr=3e-4"]` → {"train": {"steps": 50}, "optim": {...}}, in
    order: `model.moe.top_k=1` updates the `model.moe` an earlier override set."""
    tree: dict[str, dict[str, Any]] = {}
    for item in items:
        key, sep, text = item.partition("=")
        section, dot, name = key.strip().partition(".")
        if not sep or not dot or not name:
            raise ConfigError(
                f"{_name(item)}: an override is SECTION.KEY=VALUE, e.g. train.steps=50"
            )
        if section not in KEYS:
            raise _unknown(section, None)
        values = tree.setdefault(section, {})
        dotted = _field_override(section, name, text.strip())
        if dotted is not None:
            table, cls, field = dotted
            values[table] = _updated(values.get(table, Fields({})), cls, field)
        elif name in KEYS[section]:
            values[name] = _parse_override(text.strip(), KEYS[section][name])
        else:
            raise _unknown(section, name)
    return tree


def _merge(base: dict[str, Any], overrides: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """`overrides` on top of the file's tree, a table's fields into the file's table; a section
    that is not a table stays as it is, for `build_config` to name."""
    merged = {
        section: dict(values) if isinstance(values, dict) else values
        for section, values in base.items()
    }
    for section, values in overrides.items():
        target = merged.setdefault(section, {})
        if not isinstance(target, dict):
            continue
        for key, value in values.items():
            if isinstance(value, Fields):
                cls = _table_class(KEYS[section][key])
                value = _updated(target.get(key, value), cls, value.values)
            target[key] = value
    return merged


def _typed(section: str, values: dict[str, Any], preset: Any = None) -> dict[str, Any]:
    """Each key of `section` typed; a table's `Fields` over the `preset`'s table, if any."""
    out = {}
    for key, value in values.items():
        if key not in KEYS[section]:
            raise _unknown(section, key)
        if isinstance(value, Fields):
            cls = _table_class(KEYS[section][key])
            value = _updated(getattr(preset, key, None), cls, value.values)
        out[key] = _value(f"{section}.{key}", KEYS[section][key], value)
    return out


def _build(section: str, cls: type, values: dict[str, Any]) -> Any:
    typed = _typed(section, values)
    missing = [
        key_of(f)
        for f in key_fields(cls)
        if key_of(f) not in typed
        and f.default is dataclasses.MISSING
        and f.default_factory is dataclasses.MISSING
    ]
    if missing:
        raise ConfigError(
            f"{section}.{missing[0]}: required; set it in the config file or as "
            f"{section}.{missing[0]}=VALUE"
        )
    try:
        return cls(**{f.name: typed[key_of(f)] for f in key_fields(cls) if key_of(f) in typed})
    except HpDataError as exc:  # a library type's own check (e.g. a length past its bound)
        raise ConfigError(f"{section}: {_reason(exc)}") from None


def build_model(values: dict[str, Any]) -> tuple[str, ModelConfig, str | None]:
    """(preset name, `ModelConfig`, init_from) from a `[model]` table, checked alone: what
    export needs of a stored config, whose other sections may be of an older hp-train."""
    preset_name = _typed("model", {"preset": values.get("preset", "tiny")})["preset"]
    typed = _typed("model", values, PRESETS[preset_name])
    typed.pop("preset", None)
    init_from = typed.pop("init_from", None)
    try:
        model = dataclasses.replace(PRESETS[preset_name], **typed)
    except ValueError as exc:
        raise ConfigError(f"model: {exc}") from None
    return preset_name, model, init_from


def build_config(tree: dict[str, Any]) -> Config:
    """A checked `Config` from a parsed TOML tree (overrides already merged)."""
    for section, values in tree.items():
        if section not in KEYS and not isinstance(values, dict):
            hint = suggest("", section)
            raise ConfigError(
                f"{_name(section)}: a key outside any [section]; keys go under their section"
                + (f" (did you mean {hint}?)" if hint else "")
            )
        if section not in KEYS:
            raise _unknown(section, None)
        if isinstance(values, list) and values and all(isinstance(v, dict) for v in values):
            raise ConfigError(f"{section}: [[{section}]] makes a list of tables; write [{section}]")
        if not isinstance(values, dict):
            raise ConfigError(f"{section}: expected a [{section}] table, got {_shown(values)}")
    preset_name, model, init_from = build_model(tree.get("model", {}))
    sections = {name: _build(name, cls, tree.get(name, {})) for name, cls in SECTIONS.items()}
    config = Config(model_preset=preset_name, model=model, model_init_from=init_from, **sections)
    check(config)
    return config


def load_config(path: str | None, overrides: list[str] = ()) -> Config:  # type: ignore[assignment]
    """Read `path` (TOML), apply `overrides` (SECTION.KEY=VALUE), check everything."""
    tree: dict[str, Any] = {}
    if path is not None:
        try:
            with open(path, "rb") as stream:
                tree = tomllib.load(stream)
        except FileNotFoundError:
            raise ConfigError(f"{path}: no such config file") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{path}: not valid TOML: {exc}") from None
        except OSError as exc:
            raise ConfigError(f"{path}: cannot read: {exc.strerror}") from None
    return config_with(tree, list(overrides))


def config_with(tree: dict[str, Any], overrides: list[str]) -> Config:
    """A checked `Config` from a parsed TOML tree (a file's, or the one a checkpoint stores)
    with `overrides` (SECTION.KEY=VALUE) on top."""
    return build_config(_merge(tree, parse_overrides(overrides)))
