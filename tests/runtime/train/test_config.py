"""The trainer's configuration: TOML plus dotted overrides, typed, checked, one-line errors."""

from __future__ import annotations

import tomllib

import pytest
from hp_runtime.model import PRESETS
from hp_runtime.train.config import ConfigError, build_config, load_config, to_toml

BASE = ["data.type=dummy", "data.seq_length=32", "train.steps=3"]


def _error(*overrides: str, path: str | None = None) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(path, [*BASE, *overrides])
    message = str(info.value)
    assert "\n" not in message
    return message


def test_toml_and_overrides_are_typed(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text(
        '[model]\npreset = "small"\nn_layers = 3\n\n[data]\ntype = "dummy"\nseq_length = 64\n'
        "\n[train]\nsteps = 10\n\n[optim]\nlr = 1\n"
    )
    config = load_config(
        str(path),
        [
            "train.steps=50",
            "optim.lr=3e-4",
            "parallel.dp_shard=2",
            "model.vocab_size=1000",
            "data.split=98,2,0",
            "train.run_dir=out/a b",
            "model.tie_embeddings=true",
        ],
    )
    assert config.train.steps == 50 and isinstance(config.train.steps, int)
    assert config.optim.lr == 3e-4
    assert config.parallel.dp_shard == 2
    assert config.data.split == "98,2,0" and config.train.run_dir == "out/a b"
    assert config.model.vocab_size == 1000 and config.model.tie_embeddings is True
    assert config.model.n_layers == 3  # from the file
    assert config.model.dim == PRESETS["small"].dim  # from the preset
    assert load_config(str(path)).optim.lr == 1.0  # an integer is a valid float


def test_resolved_config_reads_back_to_the_same_config():
    config = load_config(None, [*BASE, "model.preset=125m", "parallel.tp_reduce_dtype=float32"])
    assert build_config(tomllib.loads(to_toml(config))) == config


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["optim.lr_warmup=5"], "optim.lr_warmup: unknown key; did you mean optim.warmup_steps?"),
        (["train.lr=1"], "train.lr: unknown key; did you mean optim.lr?"),
        (["model.vocabsize=8"], "model.vocab_size?"),
        (["optimizer.lr=1"], "optimizer: unknown section; did you mean optim?"),
        (["train.steps=abc"], "train.steps: expected an integer, got 'abc'"),
        (["train.steps=2.5"], "train.steps: expected an integer, got 2.5 (float)"),
        (["optim.lr=fast"], "optim.lr: expected a number, got 'fast'"),
        (["model.tie_embeddings=1"], "model.tie_embeddings: expected true or false, got 1"),
        (["parallel.pp_schedule=zigzag"], "parallel.pp_schedule: expected one of 'gpipe'"),
        (["model.preset=huge"], "model.preset: expected one of 'tiny', 'small'"),
        (["train.steps"], "an override is SECTION.KEY=VALUE"),
        (["train.steps=0"], "train.steps: must be from 1 to 2**31 - 1, got 0"),
        (["data.seq_length=4096"], "data.seq_length=4096 is longer than model.max_seq_len=256"),
        (["data.type=megatron"], "data.path: required for data.type = 'megatron'"),
        (["model.n_heads=3"], "model: dim=64 is not divisible by n_heads=3"),
        (["optim.min_lr=1"], "optim.min_lr=1.0 must be between 0 and optim.lr"),
        (["parallel.pp=2", "data.reset_position_ids=true"], "need parallel.pp = 1"),
    ],
)
def test_bad_values_name_the_key(overrides, message):
    assert message in _error(*overrides)


def test_missing_required_key_names_itself():
    with pytest.raises(ConfigError, match=r"^train.steps: required"):
        load_config(None, ["data.type=dummy", "data.seq_length=8"])
    with pytest.raises(ConfigError, match=r"^data.type: required"):
        load_config(None, ["train.steps=1", "data.seq_length=8"])


def test_bad_files_are_one_line(tmp_path):
    assert "no such config file" in _error(path=str(tmp_path / "missing.toml"))
    broken = tmp_path / "broken.toml"
    broken.write_text("[train\nsteps = 1\n")
    assert f"{broken}: not valid TOML" in _error(path=str(broken))
    wrong = tmp_path / "unknown.toml"
    wrong.write_text("[train]\nstep = 3\n")
    assert "train.step: unknown key; did you mean train.steps?" in _error(path=str(wrong))


@pytest.mark.parametrize("name", ["train_tiny.toml", "train_8b.toml"])
def test_shipped_examples_load(repo, name):
    config = load_config(str(repo / "examples" / name))
    assert config.train.steps > 0
