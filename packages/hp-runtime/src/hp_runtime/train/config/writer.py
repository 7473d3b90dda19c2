"""The resolved config as TOML (`config.toml`, checkpoints' `meta.json`, what hp-train
prints), which `load_config` reads back to the same `Config`. It needs only the schema."""

from __future__ import annotations

import dataclasses
from typing import Any

from hp_data.redact import redact

from hp_runtime.model.presets import PRESETS
from hp_runtime.train.config.schema import SECTIONS, Config, as_table, key_fields, key_of


def toml_value(value: Any) -> str:
    """`value` as config.toml writes it; a table key's as an inline table, none as "none"."""
    if value is None:
        return '"none"'
    if dataclasses.is_dataclass(value):
        value = as_table(value)
    if isinstance(value, dict):  # TOML has no null: a none field of a table is left out
        items = [f"{k} = {toml_value(v)}" for k, v in value.items() if v is not None]
        return "{" + ", ".join(items) + "}"
    if isinstance(value, list | tuple):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return repr(value)


def to_toml(config: Config) -> str:
    """The resolved config as TOML that `load_config` reads back to the same `Config` (keys
    whose value is none are written as comments, or as "none" where the preset has a value).
    It is stored (`config.toml`, checkpoints' `meta.json`) and printed, so a value holding a
    credential is written redacted, and says so."""
    lines = ["[model]", f'preset = "{config.model_preset}"']
    if config.model_init_from is not None:
        lines.append(f"init_from = {toml_value(config.model_init_from)}")
    preset = PRESETS[config.model_preset]
    sections: list[tuple[str, Any]] = [("model", config.model)]
    sections += [(name, getattr(config, name)) for name in SECTIONS]
    for name, section in sections:
        if name != "model":
            lines += ["", f"[{name}]"]
        for item in key_fields(section):
            value = getattr(section, item.name)
            preset_has = section is config.model and getattr(preset, item.name) is not None
            if value is None and not preset_has:
                lines.append(f"# {key_of(item)} = (none)")
            else:
                text = toml_value(value)
                if redact(text) != text:
                    lines.append(f"# {key_of(item)}: redacted, it held a credential")
                lines.append(f"{key_of(item)} = {redact(text)}")
    return "\n".join(lines) + "\n"
