"""The trainer's configuration: one TOML file plus dotted overrides, mapped onto typed, frozen
dataclasses and checked before any rank does work.

Sections: `model` (a preset plus any `ModelConfig` field), `data`, `parallel`, `train`, `optim`,
`checkpoint`, `metrics`, `eval`. An unknown section or key, a value of the wrong type or a missing
required key is a `ConfigError` whose one-line message names the key and, for a misspelling,
the closest valid one.

A module a concern, each importing only those below it: `schema` (the sections, `Config`,
`KEYS`) and `messages` at the bottom; `ranges` (each key's own values), `checks` (relations
between keys) and `paths` (the file system) on them; `values` (one value typed) on `ranges`;
`load` (files, overrides, presets) on top. `writer` (the TOML written back) needs only
`schema`. The names below are the package's face: import them from here.
"""

from hp_runtime.train.config.checks import (
    MAX_PARAMS,
    check,
    check_eval_layout,
    check_layout,
    check_length,
    check_moe,
    check_phases,
    check_profile,
)
from hp_runtime.train.config.load import (
    Fields,
    build_config,
    build_model,
    config_with,
    load_config,
    parse_overrides,
)
from hp_runtime.train.config.paths import check_paths
from hp_runtime.train.config.ranges import (
    BELOW_ONE,
    FORMS,
    INT_MAX,
    NON_NEGATIVE,
    POSITIVE,
    RANGES,
    SEED_MAX,
    UP_TO_ONE,
    Range,
)
from hp_runtime.train.config.schema import (
    KEYS,
    SECTIONS,
    BatchRamp,
    CheckpointConfig,
    Config,
    DataConfig,
    EvalConfig,
    MetricsConfig,
    OptimConfig,
    ParallelConfig,
    TrainConfig,
    WandbConfig,
    as_table,
    key_fields,
    key_of,
)
from hp_runtime.train.config.values import suggest
from hp_runtime.train.config.writer import to_toml, toml_value
from hp_runtime.train.errors import ConfigError

__all__ = [
    "BELOW_ONE",
    "FORMS",
    "INT_MAX",
    "KEYS",
    "MAX_PARAMS",
    "NON_NEGATIVE",
    "POSITIVE",
    "RANGES",
    "SECTIONS",
    "SEED_MAX",
    "UP_TO_ONE",
    "BatchRamp",
    "CheckpointConfig",
    "Config",
    "ConfigError",
    "DataConfig",
    "EvalConfig",
    "Fields",
    "MetricsConfig",
    "OptimConfig",
    "ParallelConfig",
    "Range",
    "TrainConfig",
    "WandbConfig",
    "as_table",
    "build_config",
    "build_model",
    "check",
    "check_eval_layout",
    "check_layout",
    "check_length",
    "check_moe",
    "check_paths",
    "check_phases",
    "check_profile",
    "config_with",
    "key_fields",
    "key_of",
    "load_config",
    "parse_overrides",
    "suggest",
    "to_toml",
    "toml_value",
]
