"""The mixture report a phased run records (RUN_DIR/mix-report.json), so that `hp-train
mix-report` answers for a run without reading its data again: the run's config.toml has a
URL's credentials redacted (issue 40), and the store then refuses what it names."""

from __future__ import annotations

import os
from typing import Any

from hp_data.blend import parse_blend
from hp_data.phase_report import mix_report
from hp_data.phases import PhasePlan
from hp_data.redact import MASK

from hp_runtime.train import storage
from hp_runtime.train.config import Config, check_paths, load_config
from hp_runtime.train.errors import ConfigError, TrainError

RECORD = "mix-report.json"


def write_record(plan: PhasePlan, run_dir: str) -> None:
    """RUN_DIR/mix-report.json: `mix_report(plan)` (redacted, as it prints), whole or not at
    all; written at every start, so that it is the report of the config.toml beside it."""
    path = os.path.join(run_dir, RECORD)
    storage.write_json(path, mix_report(plan))


def read_record(run_dir: str) -> dict[str, Any]:
    """The report a run recorded; a TrainError naming the directory when it has none."""
    path = os.path.join(run_dir, RECORD)
    if not os.path.isfile(path):
        raise TrainError(
            f"{run_dir}: no {RECORD} here: give the directory of a run that trained "
            "data.phases, or --config FILE"
        )
    try:
        return storage.read_json(path)
    except ValueError as exc:  # storage.Damaged: cut, garbled or edited
        raise TrainError(f"{exc}: start the run again to write it, or give --config") from None


def redacted_key(config: Config) -> str | None:
    """The first `data.phases[i].path` naming a URL whose credential a run's config.toml
    holds as `***` (its user, password or a secret query value): what the store refuses."""
    for i, phase in enumerate(config.data.phases):
        for prefix in parse_blend(phase.path)[0]:
            if "://" in prefix and (f"{MASK}@" in prefix or f"={MASK}" in prefix):
                return f"data.phases[{i}].path"
    return None


def report(
    config_path: str | None, run_dir: str | None, overrides: list[str]
) -> dict[str, Any] | Config:
    """What `hp-train mix-report` prints: a run's record (RUN_DIR, or its config.toml with a
    redacted credential and no overrides), else the config to count the report from."""
    if run_dir is not None and config_path is None:
        if not overrides:
            return read_record(run_dir)
        config_path = os.path.join(run_dir, "config.toml")
    config = load_config(config_path, overrides)
    key = redacted_key(config)
    if key is not None:
        beside = os.path.dirname(os.path.abspath(config_path or "."))
        if not overrides and os.path.isfile(os.path.join(beside, RECORD)):
            return read_record(beside)
        raise ConfigError(
            f"{key}: its URL's credential was redacted when the run wrote {config_path}, and "
            f"the store needs it to count {'these overrides' if overrides else 'the report'}; "
            "give the credential in the store's environment or fsspec configuration, or the "
            f"URL with it as an override of {key.split('[')[0]}"
        )
    check_paths(config)
    return config
