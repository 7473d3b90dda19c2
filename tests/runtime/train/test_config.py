"""The trainer's configuration: TOML plus dotted overrides, typed, checked, one-line errors."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import tempfile
import tomllib
import typing
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from hp_runtime.model import PRESETS
from hp_runtime.model.config import MoEConfig
from hp_runtime.train.config import (
    KEYS,
    RANGES,
    ConfigError,
    WandbConfig,
    build_config,
    check_paths,
    load_config,
    to_toml,
)
from hp_runtime.train.launch import Runtime
from hp_runtime.train.setup import checked_plan
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

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


def test_a_credential_in_the_resolved_config_is_written_redacted():
    url = "https://user:s3cr3t@host/c.jsonl?X-Amz-Signature=SIG"
    text = to_toml(load_config(None, [*BASE, f"data.valid_path={url}"]))
    assert "s3cr3t" not in text and "SIG" not in text
    assert '\nvalid_path = "https://***:***@host/c.jsonl?X-Amz-Signature=***"\n' in text
    assert "# valid_path: redacted, it held a credential\n" in text


def test_resolved_config_reads_back_to_the_same_config():
    config = load_config(None, [*BASE, "model.preset=125m", "parallel.tp_reduce_dtype=float32"])
    assert build_config(tomllib.loads(to_toml(config))) == config


@pytest.mark.parametrize(
    ("toml", "got"),
    [('"sometimes"', "'sometimes'"), ("true", "True (bool)"), ("1", "1 (int)"), ('""', "''")],
)
def test_fsdp_reshard_after_forward_takes_always_or_never(tmp_path, toml, got):
    key = "parallel.fsdp_reshard_after_forward"
    assert load_config(None, BASE).parallel.fsdp_reshard_after_forward == "always"
    assert load_config(None, [*BASE, f"{key}=never"]).parallel.fsdp_reshard_after_forward == "never"
    path = tmp_path / "run.toml"
    path.write_text(f"[parallel]\nfsdp_reshard_after_forward = {toml}\n")
    assert _error(path=str(path)) == f"{key}: expected one of 'always', 'never', got {got}"
    assert _error(f"{key}=sometimes").endswith("got 'sometimes'")  # the command line alike


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["optim.lr_warmup=5"], "optim.lr_warmup: unknown key; did you mean optim.warmup_steps?"),
        (["train.lr=1"], "train.lr: unknown key; did you mean optim.lr?"),
        (["model.vocabsize=8"], "model.vocab_size?"),
        (["optimizer.lr=1"], "optimizer: unknown section; did you mean optim?"),
        (["train.steps=abc"], "train.steps: expected an integer, got 'abc'"),
        (["train.steps=2.5"], "train.steps: expected an integer, got 2.5 (float)"),
        (["train.loss_chunk_tokens=1024.5"], "train.loss_chunk_tokens: expected an integer"),
        (["train.loss_chunk_tokens=auto"], "train.loss_chunk_tokens: expected an integer"),
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
        (["model.attention=fast"], "model.attention: expected one of 'auto', 'sdpa', 'flex'"),
        (["model.attention=1"], "model.attention: expected one of 'auto', 'sdpa', 'flex'"),
        (
            ["model.attention=segments", "data.document_masking=true", "parallel.compile=true"],
            "model.attention = 'segments' reads document boundaries on the host",
        ),
    ],
)
def test_bad_values_name_the_key(overrides, message):
    assert message in _error(*overrides)


def test_attention_modes_check_the_device_and_the_pipeline_takes_documents():
    flex = load_config(None, [*BASE, "model.attention=flex"])
    with pytest.raises(ConfigError, match=r"^model.attention = 'flex' cannot train on the CPU"):
        checked_plan(flex, ONE_RANK)
    checked_plan(flex, Runtime(0, 1, 0, 1, torch.device("cuda")))
    documents = ["data.document_masking=true", "data.reset_position_ids=true"]
    for pp in (2, 3):
        config = load_config(None, [*BASE, f"parallel.pp={pp}", "model.n_layers=3", *documents])
        checked_plan(config, Runtime(0, pp, 0, pp, torch.device("cpu")))


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


@pytest.mark.parametrize("name", ["train_tiny.toml", "train_8b.toml", "train_moe.toml"])
def test_shipped_examples_load(repo, name):
    config = load_config(str(repo / "examples" / name))
    assert config.train.steps > 0
    world = config.parallel.world_size
    checked_plan(config, Runtime(0, world, 0, world, torch.device("cpu")))
    if name == "train_moe.toml":
        assert config.model.moe is not None and config.model.moe.experts > config.model.moe.top_k


# --- every key's range, and configs drawn at random --------------------------------------------

ONE_RANK = Runtime(0, 1, 0, 1, torch.device("cpu"))


def _numeric(kind) -> bool:
    """A number, or one or none; a list of numbers (`metrics.profile_steps`) is checked whole,
    by its own form (config.FORMS)."""
    if typing.get_origin(kind) is tuple:
        return False
    return kind in (int, float) or any(_numeric(a) for a in typing.get_args(kind))


def test_every_numeric_key_has_a_range_and_its_default_is_in_it():
    from hp_runtime.model.config import MLAConfig, MoEConfig, MTPConfig
    from hp_runtime.parallel.options import FaultTolerance
    from hp_runtime.train.config import BatchRamp, key_fields
    from hp_runtime.train.config.schema import Muon

    numeric = {
        f"{s}.{k}" for s, names in KEYS.items() for k, kind in names.items() if _numeric(kind)
    }
    for name, table in (("moe", MoEConfig), ("mla", MLAConfig), ("mtp", MTPConfig)):
        hints = typing.get_type_hints(table)  # these tables' fields are ranged as keys are
        numeric |= {f"model.{name}.{f.name}" for f in key_fields(table) if _numeric(hints[f.name])}
    numeric |= {f"train.batch_ramp.{f.name}" for f in key_fields(BatchRamp)}  # all integers
    hints = typing.get_type_hints(Muon)
    numeric |= {f"optim.muon.{f.name}" for f in key_fields(Muon) if _numeric(hints[f.name])}
    hints = typing.get_type_hints(FaultTolerance)
    numeric |= {
        f"parallel.fault_tolerance.{f.name}"
        for f in key_fields(FaultTolerance)
        if _numeric(hints[f.name])
    }
    assert numeric == set(RANGES)
    for key in (k for k in RANGES if k.startswith("parallel.fault_tolerance.")):
        assert getattr(FaultTolerance(), key.split(".")[2]) in RANGES[key], key
    for key in (k for k in RANGES if k.startswith("optim.muon.")):
        assert getattr(Muon(), key.split(".")[2]) in RANGES[key], key
    defaults = MoEConfig(experts=1, top_k=1, expert_ffn_hidden=1)
    for key in (k for k in RANGES if k.startswith("model.moe.")):
        assert getattr(defaults, key.split(".")[2]) in RANGES[key], key
    load_config(None, [*BASE, *(f"model.preset={name}" for name in PRESETS)])  # presets in range


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("optim.decay_steps=0", "optim.decay_steps: must be from 1 to 2**31 - 1, got 0"),
        ("optim.decay_steps=-5", "optim.decay_steps: must be from 1 to 2**31 - 1, got -5"),
        ("model.n_heads=0", "model.n_heads: must be from 1 to 2**31 - 1, got 0"),
        ("model.dim=-64", "model.dim: must be from 1 to 2**31 - 1, got -64"),
        ("model.dim=1000000000000", "model.dim: must be from 1 to 2**31 - 1"),
        ("model.n_layers=100000", "model.n_layers: must be from 1 to 4096, got 100000"),
        ("model.max_seq_len=0", "model.max_seq_len: must be from 1 to 2**24, got 0"),
        ("model.norm_eps=-1e-5", "model.norm_eps: must be in (0, 1], got -1e-05"),
        ("model.rope_theta=0", "model.rope_theta: must be more than 0, got 0.0"),
        ("model.init_std=0", "model.init_std: must be in (0, 1], got 0.0"),
        ("optim.lr=-0.001", "optim.lr: must be more than 0, got -0.001"),
        ("optim.lr=0", "optim.lr: must be more than 0, got 0.0"),
        ("optim.beta2=1", "optim.beta2: must be in [0, 1), got 1.0"),
        ("optim.momentum=-0.1", "optim.momentum: must be in [0, 1), got -0.1"),
        ("optim.eps=0", "optim.eps: must be more than 0"),
        ("optim.weight_decay=-1", "optim.weight_decay: must be at least 0"),
        ("optim.wsd_decay_fraction=0", "optim.wsd_decay_fraction: must be in (0, 1]"),
        ("train.steps=" + "1" + "0" * 30, "train.steps: must be from 1 to 2**31 - 1"),
        ("train.seed=-1", "train.seed: must be from 0 to 2**32 - 1, got -1"),
        ("train.time_limit=-1", "train.time_limit: must be at least 0"),
        ("train.loss_chunk_tokens=-1", "train.loss_chunk_tokens: must be from 0 to 2**31 - 1"),
        ("train.loss_chunk_tokens=" + str(2**31), "train.loss_chunk_tokens: must be from 0 to"),
        ("train.max_norm=-1", "train.max_norm: must be at least 0"),
        ("data.seq_length=1", "data.seq_length: must be from 2 to 2**31 - 2, got 1"),
        ("data.num_workers=100000", "data.num_workers: must be from 0 to 1024"),
        ("metrics.peak_tflops=0", "metrics.peak_tflops: must be more than 0"),
        ("optim.lr=nan", "optim.lr: expected a number, got nan"),
        ("data.eod_token=256", "data.eod_token = 256 is not a token id of model.vocab_size = 256"),
        ("data.split=1,x", "data.split: expected up to three non-negative shares"),
    ],
)
def test_out_of_range_values_name_key_value_and_range(override, message):
    assert message in _error(override)


def test_a_model_past_the_parameter_limit_is_refused_before_allocation():
    # (2**31 - 1) x 1024 x 2 embeddings alone are 4.4e12 parameters, over 2**40 = 1.1e12
    message = _error("model.vocab_size=2147483647", "model.dim=1024")
    assert message.startswith("model: 4.4e+12 parameters (model.dim=1024, n_layers=2")
    load_config(None, [*BASE, "model.vocab_size=2147483647"])  # 2.7e11 at dim 64: allowed


def _path_error(*overrides: str) -> str:
    with pytest.raises(ConfigError) as info:
        check_paths(load_config(None, [*BASE, *overrides]))
    assert "\n" not in str(info.value)
    return str(info.value)


def test_paths_are_checked_before_the_run(example_tokenizer):
    # A short directory: messages shorten values past 80 characters, and pytest's own
    # (a worker's under xdist) can be longer.
    with tempfile.TemporaryDirectory(prefix="hp-") as name:
        _check_paths(Path(name), example_tokenizer)


def _check_paths(tmp_path: Path, example_tokenizer: Path) -> None:
    file = tmp_path / "file"
    file.write_text("mine")
    missing = tmp_path / "missing"
    cases = {
        f"train.run_dir={file}": f"train.run_dir: '{file}': it is not a directory",
        f"train.run_dir={file}/run": f"train.run_dir: '{file}/run': '{file}' is not a directory",
        f"data.cache_dir={file}": f"data.cache_dir: '{file}': it is not a directory",
        "train.run_dir=a\0b": "train.run_dir: 'a\\x00b' cannot be a path",
        f"train.run_dir={tmp_path}/{'x' * 300}": "the name is too long",
        f"model.init_from={missing}": f"model.init_from: '{missing}': no such file or directory",
        f"model.init_from={file}": f"model.init_from: '{file}' is not a directory",
        "checkpoint.resume=a\0b": "checkpoint.resume: 'a\\x00b' cannot be a path",
    }
    for override, message in cases.items():
        assert message in _path_error(override)
    assert file.read_text() == "mine"
    text = ["data.type=json_file", f"data.tokenizer={example_tokenizer}"]
    assert f"data.path: '{missing}': no such" in _path_error(*text, f"data.path={missing}")
    hf = ["data.type=hf_datasets", f"data.tokenizer={example_tokenizer}", f"data.path={file}"]
    assert f"data.path: '{file}' is not a directory" in _path_error(*hf)
    bad_tokenizer = ["data.type=json_file", f"data.path={file}", f"data.tokenizer={missing}"]
    assert _path_error(*bad_tokenizer).startswith(f"data.tokenizer: {missing}: no such")
    # a missing resume path is the checkpointer's to refuse: a run with checkpoints ignores it
    check_paths(load_config(None, [*BASE, f"checkpoint.resume={missing}"]))
    run_dir = tmp_path / "new" / "run"  # a directory still to create is fine
    check_paths(load_config(None, [*BASE, *text, f"data.path={file}", f"train.run_dir={run_dir}"]))
    assert not run_dir.parent.exists()  # the check creates nothing


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes anywhere")
def test_a_read_only_run_dir_is_refused(tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    assert "train.run_dir" in _path_error(f"train.run_dir={locked}/run")
    assert "is not writable" in _path_error(f"train.run_dir={locked}/run")


def test_megatron_prefixes_and_blends(tmp_path):
    for suffix in (".bin", ".idx"):
        (tmp_path / f"a{suffix}").write_bytes(b"")
    a, b = tmp_path / "a", tmp_path / "b"
    check_paths(load_config(None, [*BASE, "data.type=megatron", f"data.path={a}"]))
    check_paths(load_config(None, [*BASE, "data.type=megatron", f"data.path={a}.bin"]))
    mega = [*BASE, "data.type=megatron"]
    assert f"data.path: '{b}.idx': no such file" in _path_error(*mega, f"data.path=0.3 {a} 0.7 {b}")
    (tmp_path / "b.idx").write_bytes(b"")
    assert f"'{b}.bin': no such file" in _path_error(*mega, f"data.path=0.3 {a} 0.7 {b}")
    odd = _path_error(*mega, f"data.path=0.3 {a} 0.7")
    assert odd.startswith("data.path") and "expected weight/prefix pairs" in odd
    assert "--data-path" not in odd  # hp-train's key, not Megatron's flag
    quoted = _path_error(*mega, f"data.path=--data-path {a}")  # the user's text, quoted as is
    assert quoted == "data.path: blend: '--data-path' is not a weight; write 'WEIGHT PREFIX' pairs"
    valid = _path_error(*mega, f"data.path={a}", f"data.valid_path={b}")
    assert valid.startswith("data.valid_path:")


@pytest.mark.parametrize(
    ("toml", "message"),
    [
        ("steps = 5\n", "steps: a key outside any [section]; keys go under their section (did "),
        ("lr = [1e-3]\n", "lr: a key outside any [section]"),
        ("model = 3\n", "model: expected a [model] table, got 3 (int)"),
        ("[[train]]\nsteps = 1\n", "train: [[train]] makes a list of tables; write [train]"),
        ('"a\\nb" = 1\n', "'a\\nb': a key outside any [section]"),
    ],
)
def test_top_level_shapes_are_one_line(tmp_path, toml, message):
    path = tmp_path / "run.toml"
    path.write_text(toml)
    assert message in _error(path=str(path))


@pytest.fixture(scope="module")
def places(tmp_path_factory):
    """A file, a directory, a Megatron prefix and a name that does not exist, for drawn values."""
    root = tmp_path_factory.mktemp("drawn")
    (root / "file").write_text("user data")
    (root / "dir").mkdir()
    for suffix in (".bin", ".idx"):
        (root / f"prefix{suffix}").write_bytes(b"")
    return {
        "file": str(root / "file"),
        "dir": str(root / "dir"),
        "missing": str(root / "no"),
        "prefix": str(root / "prefix"),
    }


DOTTED = sorted(f"{section}.{key}" for section, names in KEYS.items() for key in names)
ODD_TEXTS = [
    "",
    " ",
    "é☃🙂",
    "../..",
    "x" * 5000,
    "a\nb",
    "none",
    "true",
    "[1, 2]",
    "{a = 1}",
    "[{a = 1}]",
    '"quoted"',
    "nan",
    "inf",
    "-inf",
    "1e999",
    "0x10",
    "-0",
]
NUMBERS = [
    "0",
    "-1",
    "1",
    "2",
    "3",
    "8",
    "0.5",
    "1.0",
    "-1e-9",
    "1e300",
    "1e-320",
    "1000000000000",
    "1" + "0" * 30,
    str(2**31),
    str(2**63),
    str(-(2**63) - 1),
]


def _bases(places, tokenizer) -> dict[str, list[str]]:
    return {
        "dummy": BASE,
        "json_file": [
            *BASE,
            "data.type=json_file",
            f"data.path={places['file']}",
            f"data.tokenizer={tokenizer}",
        ],
        "megatron": [*BASE, "data.type=megatron", f"data.path={places['prefix']}"],
    }


def _load_and_check(overrides: list[str]) -> str | None:
    """None when the config passes every pre-run check, else its one-line error."""
    try:
        config = load_config(None, overrides)
        check_paths(config)
        checked_plan(config, ONE_RANK)
    except ConfigError as exc:
        message = str(exc)
        assert "\n" not in message and len(message) < 600, message
        return message
    return None


def _names_a_key(message: str) -> bool:
    return any(k in message for k in DOTTED) or any(message.startswith(f"{s}:") for s in KEYS)


@pytest.mark.parametrize("base", ["dummy", "json_file", "megatron"])
def test_every_key_with_every_odd_value(places, example_tokenizer, base, tmp_path):
    """Each key alone set to zero, negative, huge, non-finite, a wrong type, odd text or a path
    of the wrong kind: it loads, or one ConfigError line names the key."""
    overrides = [*_bases(places, example_tokenizer)[base], f"train.run_dir={tmp_path}/run"]
    paths = [*places.values(), *(p + "/sub" for p in places.values())]
    for key in DOTTED:
        for value in ODD_TEXTS + NUMBERS + paths:
            message = _load_and_check([*overrides, f"{key}={value}"])
            if message is not None:
                assert key.split(".")[1] in message, (key, value, message)
    assert not (tmp_path / "run").exists() and Path(places["file"]).read_text() == "user data"


def _values(places):
    return st.one_of(
        st.sampled_from(ODD_TEXTS + NUMBERS),
        st.integers(min_value=-(2**70), max_value=2**70).map(str),
        st.floats(allow_nan=True, allow_infinity=True).map(repr),
        st.text(max_size=30),
        st.sampled_from(
            [
                "gpipe",
                "cosine",
                "wsd",
                "megatron",
                "json_file",
                "hf_datasets",
                "skip",
                "cpu",
                "selective",
                "0.5 /nonexistent 0.5",
            ]
        ),
        st.sampled_from(list(places.values())),
    )


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_drawn_configs_load_or_fail_in_one_line_naming_a_key(places, example_tokenizer, data):
    """Several keys drawn at once (relations between them too): never another exception."""
    base = data.draw(st.sampled_from(list(_bases(places, example_tokenizer).values())))
    drawn = data.draw(
        st.lists(st.tuples(st.sampled_from(DOTTED), _values(places)), min_size=1, max_size=4)
    )
    overrides = [*base, f"train.run_dir={places['dir']}/run", *(f"{k}={v}" for k, v in drawn)]
    message = _load_and_check(overrides)
    assert message is None or _names_a_key(message), message


def test_the_data_section_is_the_registry_config_and_hides_only_what_it_fixes():
    """Each of hp-data's dataset fields is a [data] key under its own name, or one hp-train
    keeps fixed and refuses as a key; the data a run builds from is that same object."""
    import dataclasses

    from hp_data.registry import DatasetConfig
    from hp_runtime.train.batch import batch_plan
    from hp_runtime.train.config import DataConfig, key_fields
    from hp_runtime.train.data import resolve_data

    library = {f.name for f in dataclasses.fields(DatasetConfig)}
    keys = {f.name for f in key_fields(DataConfig)}
    assert library - keys == set(DataConfig.fixed)
    trainer = {"valid_path", "phases", "document_masking", "num_workers", "prefetch_factor"}
    assert keys - library == trainer  # phases: by step, which the trainer's batch plan counts
    for name in DataConfig.fixed:
        with pytest.raises(ConfigError, match=f"data.{name}: unknown key"):
            load_config(None, [*BASE, f"data.{name}=1"])
    config = load_config(None, [*BASE, "data.seed=7", "model.vocab_size=333", "train.run_dir=/run"])
    built = resolve_data(config, batch_plan(config), validation=False).sources["train"].config
    assert isinstance(built, DatasetConfig) and built.seed == 7 and built.vocab_size == 333
    assert built.cache_dir == os.path.join("/run", "index-cache")


def _documented_keys(section: str) -> list[str]:
    """The keys of `section`'s table in docs/training.md, in the order it lists them."""
    text = (Path(__file__).resolve().parents[3] / "docs" / "training.md").read_text()
    body = text.split(f"### `[{section}]`", 1)[1].split("\n#", 1)[0]
    return [row.split("`")[1] for row in body.splitlines() if row.startswith("| `")]


def test_the_data_keys_keep_the_documented_order():
    """config.toml lists [data] as docs/training.md does, and the first missing key named is
    the first one there (the library's fields come first in the dataclass)."""
    text = to_toml(load_config(None, BASE))
    section = text.split("[data]\n", 1)[1].split("\n[", 1)[0]
    written = [line.lstrip("# ").split(" = ")[0] for line in section.splitlines() if " = " in line]
    assert written == _documented_keys("data")
    with pytest.raises(ConfigError, match=r"^data\.type: required"):
        load_config(None, ["train.steps=3"])


@pytest.mark.parametrize("length", [2**31 - 3, 2**31 - 2, 2**31 - 1, 2**31])
def test_a_sequence_length_the_library_refuses_is_refused_by_its_key(length):
    """data.seq_length takes exactly the lengths hp-data's GPTDatasetConfig takes, and a
    refusal names the key (not "data: seq_length ...")."""
    from hp_data.gpt import GPTDatasetConfig
    from hp_data.index import IndexBuildError

    try:
        GPTDatasetConfig(seq_length=length)
        library_takes = True
    except IndexBuildError:
        library_takes = False
    message = _error(f"data.seq_length={length}")  # beyond model.max_seq_len, at most 2**24
    if library_takes:
        assert message.startswith(f"data.seq_length={length} is longer than model.max_seq_len")
    else:
        assert message.startswith("data.seq_length: must be from 2"), message


# --- a MoE model's keys ------------------------------------------------------------------------

MOE = {"experts": "4", "top_k": "2", "expert_ffn_hidden": "32"}


def _moe(**fields: str) -> str:
    """A `model.moe=` override: the table MOE with `fields` (TOML literals) replaced."""
    table = {**MOE, **fields}
    return "model.moe={" + ", ".join(f"{k} = {v}" for k, v in table.items()) + "}"


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ([_moe(top_k="8")], "model.moe.top_k: is more than experts=4, got 8"),
        ([_moe(router='"topk"')], "model.moe.router: expected one of 'softmax', 'sigmoid'"),
        ([_moe(load_balance='"loss"')], "model.moe.load_balance: expected one of 'aux_loss'"),
        ([_moe(expert='3')], "model.moe.expert: unknown field; did you mean model.moe.experts?"),
        ([_moe(expert_hidden='3')], "did you mean model.moe.expert_ffn_hidden?"),
        (["model.moe=8"], "model.moe: expected a table {experts, top_k, expert_ffn_hidden,"),
        (['model.moe="softmax"'], "model.moe: expected a table {experts"),
        (["model.moe={experts = 4}"], "model.moe.top_k: required; model.moe needs experts, "
                                      "top_k, expert_ffn_hidden (the other fields have defaults)"),
        (["model.moe.top_k=4"], "model.moe.experts: required; model.moe needs experts, "
                                "top_k, expert_ffn_hidden"),  # a dense preset: a new table
        ([_moe(experts="0")], "model.moe.experts: must be from 1 to 2**31 - 1, got 0"),
        ([_moe(experts="4.0")], "model.moe.experts: expected an integer, got 4.0 (float)"),
        ([_moe(shared_experts="-1")], "model.moe.shared_experts: must be from 0 to 2**31 - 1"),
        ([_moe(route_scale="0")], "model.moe.route_scale: must be more than 0, got 0.0"),
        ([_moe(route_scale="nan")], "model.moe.route_scale: expected a number, got nan"),
        ([_moe(aux_loss_coef="-0.1")], "model.moe.aux_loss_coef: must be at least 0, got -0.1"),
        ([_moe(bias_update_rate='"fast"')], "model.moe.bias_update_rate: expected a number"),
        ([_moe(renormalize="1")], "model.moe.renormalize: expected true or false, got 1"),
        ([_moe(first_dense_layers="2")], "model: moe.first_dense_layers=2 leaves no MoE layer "
                                         "of n_layers=2"),
        ([_moe(expert_ffn_hidden="2147483647")], "parameters (model.dim=64, n_layers=2, "
         "ffn_hidden=172, vocab_size=256, moe.experts=4, moe.expert_ffn_hidden=2147483647"),
        (["parallel.ep=0"], "parallel.ep: must be from 1 to 2**31 - 1, got 0"),
        (["parallel.ep=two"], "parallel.ep: expected an integer, got 'two'"),
        (["parallel.ep=2", "parallel.dp_shard=2"],
         "parallel.ep=2 needs a MoE model: set model.moe"),
        ([_moe(experts="6"), "parallel.ep=4", "parallel.dp_shard=4"],
         "model.moe.experts=6 is not divisible by parallel.ep=4"),
        ([_moe(), "parallel.ep=2"], "parallel.ep=2 does not divide parallel.dp_shard=1: expert "
                                    "parallelism splits the sharded data-parallel ranks"),
        ([_moe(), "parallel.ep=2", "parallel.dp_shard=3"], "parallel.ep=2 does not divide "
                                                           "parallel.dp_shard=3"),
        ([_moe(), "parallel.cp=2"], "model.moe with parallel.cp=2 is not supported yet"),
        ([_moe(), "parallel.ep=2", "parallel.dp_shard=2", "parallel.compile=true"],
         "parallel.compile = true with parallel.ep=2 is not supported yet: set "
         "parallel.compile = false"),
    ],
)  # fmt: skip
def test_bad_moe_values_name_the_key(overrides, message):
    assert message in _error(*overrides)


def test_moe_keys_read_from_a_file_and_back(tmp_path):
    path = tmp_path / "moe.toml"
    path.write_text(
        "[model]\nn_layers = 3\n[model.moe]\nexperts = 8\ntop_k = 2\nexpert_ffn_hidden = 16\n"
        'router = "sigmoid"\nload_balance = "bias"\nfirst_dense_layers = 1\n'
        "[parallel]\ndp_shard = 4\nep = 2\n"
    )
    config = load_config(str(path), BASE)
    moe = config.model.moe
    assert (moe.experts, moe.router, moe.load_balance, moe.first_dense_layers) == (
        8, "sigmoid", "bias", 1
    )  # fmt: skip
    assert config.parallel.ep == 2 and moe.aux_loss_coef == 0.01  # the defaults fill the rest
    assert build_config(tomllib.loads(to_toml(config))) == config
    assert load_config(str(path), [*BASE, "model.moe=none", "parallel.ep=1"]).model.moe is None


def test_moe_layouts_are_checked_against_the_world_size():
    config = load_config(None, [*BASE, _moe(), "parallel.dp_shard=4", "parallel.ep=2"])
    checked_plan(config, Runtime(0, 4, 0, 4, torch.device("cpu")))  # dp_shard 4 = 2 x ep 2
    with pytest.raises(ConfigError) as info:
        checked_plan(config, Runtime(0, 8, 0, 8, torch.device("cpu")))
    message = str(info.value)
    assert message.startswith("parallel: dp_replicate*dp_shard*cp*tp*pp = 1*4*1*1*1 = 4, but")
    assert "the world size is 8" in message and "parallel.ep adds no ranks" in message


MOE_VALUES = ["0", "-1", "1", "3", "1.5", '"x"', '""', "true", "nan", "inf", "-inf", "[1]",
              "{a = 1}", str(2**31), str(2**63 - 1), "1e300", '"softmax"', '"bias"',
              "1e-320"]  # fmt: skip


def test_every_moe_field_with_every_odd_value():
    """Each model.moe field alone set to a wrong type, out of range, an odd name, a table:
    it loads and passes the layout check, or one ConfigError line names the field."""
    from hp_runtime.model.config import MoEConfig
    from hp_runtime.train.config import key_fields

    for name in (f.name for f in key_fields(MoEConfig)):
        for value in MOE_VALUES:
            message = _load_and_check([*BASE, _moe(**{name: value})])
            if message is not None:
                named = f"model.moe.{name}" in message or f"{name}=" in message
                assert named, (name, value, message)


def test_a_bad_moe_key_through_the_installed_command_is_one_line(tmp_path):
    from tests.helpers.train import hp_train

    done = hp_train(*BASE, _moe(router='"top"'), f"train.run_dir={tmp_path}/run")
    assert done.returncode == 2  # a config error, as a usage error
    assert done.stderr.strip() == (
        "hp-train: error: model.moe.router: expected one of 'softmax', 'sigmoid', got 'top'"
    )
    assert not (tmp_path / "run").exists()


# --- a field of a table key set alone (`model.moe.top_k=1`) -------------------------------------


def _toml(value: object) -> str:
    """A value as TOML writes it, written here (not config.toml_value, which is under test)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list | tuple):
        return "[" + ", ".join(map(_toml, value)) + "]"
    return json.dumps(value) if isinstance(value, str) else repr(value)


def _inline(table: dict) -> str:
    return "{" + ", ".join(f"{k} = {_toml(v)}" for k, v in table.items()) + "}"


def test_a_field_updates_the_table_the_preset_or_the_file_has(repo, tmp_path):
    """As TOML's dotted keys: the field into the table the config has (the preset's, wherever
    model.preset is set, as any other model key; the file's; an earlier override's), every
    other field kept; a whole table set later replaces it."""
    moe_tiny, llama = PRESETS["moe-tiny"].moe, PRESETS["llama3-1b"].rope_scaling
    for order in (["model.preset=moe-tiny", "model.moe.top_k=1"],
                  ["model.moe.top_k=1", "model.preset=moe-tiny"]):  # fmt: skip
        assert load_config(None, [*BASE, *order]).model.moe == replace(moe_tiny, top_k=1)
    preset_file = tmp_path / "moe.toml"
    preset_file.write_text('[model]\npreset = "moe-tiny"\n')
    assert load_config(str(preset_file), [*BASE, "model.moe.top_k=1"]).model.moe == replace(
        moe_tiny, top_k=1
    )
    example = repo / "examples" / "train_moe.toml"
    table = tomllib.loads(example.read_text())["model"]["moe"]
    both = ["model.moe.top_k=1", "model.moe.router=sigmoid", "model.moe.load_balance=bias"]
    got = load_config(str(example), both).model.moe
    assert got == MoEConfig(**{**table, "top_k": 1, "router": "sigmoid", "load_balance": "bias"})
    whole = {"experts": 4, "top_k": 2, "expert_ffn_hidden": 16}
    then_field = [f"model.moe={_inline(whole)}", "model.moe.experts=6"]
    assert load_config(None, [*BASE, *then_field]).model.moe == MoEConfig(6, 2, 16)
    field_then = ["model.preset=moe-tiny", "model.moe.top_k=1", f"model.moe={_inline(whole)}"]
    assert load_config(None, [*BASE, *field_then]).model.moe == MoEConfig(4, 2, 16)
    factor = ["model.preset=llama3-1b", "model.rope_scaling.factor=16"]
    assert load_config(None, [*BASE, *factor]).model.rope_scaling == replace(llama, factor=16.0)
    ramp_file = tmp_path / "ramp.toml"
    ramp_file.write_text("[train]\nglobal_batch_size = 8\nbatch_ramp = [2, 2, 100]\n")
    ramp = load_config(str(ramp_file), [*BASE, "train.batch_ramp.samples=40"]).train.batch_ramp
    assert (ramp.start, ramp.increment, ramp.samples) == (2, 2, 40)
    wandb = load_config(None, [*BASE, "metrics.wandb.project=p", "metrics.wandb.mode=offline"])
    assert wandb.metrics.wandb == WandbConfig(project="p", mode="offline")
    for config in (load_config(str(example), ["model.moe.top_k=1"]),
                   load_config(None, [*BASE, *factor])):  # fmt: skip
        assert build_config(tomllib.loads(to_toml(config))) == config  # written whole, read back


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["model.moe.top_k=1"], "model.moe.experts: required; model.moe needs experts, top_k, "
                                "expert_ffn_hidden (the other fields have defaults)"),
        (["model.preset=moe-tiny", "model.moe=none", "model.moe.top_k=1"],
         "model.moe.experts: required"),  # unset, then a new table of one field
        (["model.rope_scaling.factor=16"], "model.rope_scaling.type: required; model.rope_scaling "
                                           "needs type, factor (the other fields have defaults)"),
        (["model.mla.v_head_dim=16"], "model.mla.kv_lora_rank: required; model.mla needs "
         "kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim (the other fields have "
         "defaults)"),
        (["metrics.wandb.mode=offline"], "metrics.wandb.project: required"),
        (["train.batch_ramp.start=2"], "train.batch_ramp.increment: required"),
        (["model.preset=moe-tiny", "model.moe.top_k=0"],
         "model.moe.top_k: must be from 1 to 2**31 - 1, got 0"),
        (["model.preset=moe-tiny", "model.moe.top_k=9"],
         "model.moe.top_k: is more than experts=8, got 9"),
        (["model.preset=moe-tiny", "model.moe.top_k=two"],
         "model.moe.top_k: expected an integer, got 'two'"),
        (["model.preset=moe-tiny", "model.moe.route_scale=nan"],
         "model.moe.route_scale: expected a number, got nan"),
        (["model.preset=llama3-1b", "model.rope_scaling.factor=0.5"],
         "model.rope_scaling.factor: must be at least 1, got 0.5"),
        (["model.moe.topk=1"], "model.moe.topk: unknown field; did you mean model.moe.top_k? "
                               "its fields: experts, top_k, expert_ffn_hidden, shared_experts, "
                               "router, renormalize, route_scale, first_dense_layers, "
                               "load_balance, aux_loss_coef, bias_update_rate"),
        (["model.rope_scaling.theta=1"], "model.rope_scaling.theta: unknown field; its fields: "
                                         "type, factor, low_freq_factor, high_freq_factor, "
                                         "original_max_seq_len"),
        (["model.moe.top_k.x=1"], "model.moe.top_k.x: unknown field; did you mean "
                                  "model.moe.top_k?"),
        (["train.steps.x=1"], "train.steps.x: unknown key"),
        (["data.phases.path=x"], "data.phases.path: unknown key"),  # an array, not a table
    ],
)  # fmt: skip
def test_a_bad_field_is_one_line_naming_it(overrides, message):
    got = _error(*overrides)
    assert got.startswith(message), got


TABLE_KEYS = {  # the table keys, found in the schema: a dataclass or none (not an array)
    f"{section}.{key}": typing.get_args(kind)[0]
    for section, names in KEYS.items()
    for key, kind in names.items()
    if typing.get_origin(kind) is not tuple
    and typing.get_args(kind)
    and dataclasses.is_dataclass(typing.get_args(kind)[0])
}
# For each, a config that has the table (a preset's, or one set whole) and one that has none.
WITH_TABLE = {
    "model.moe": ["model.preset=moe-tiny"],
    "model.rope_scaling": ["model.preset=llama3-1b"],
    "model.mla": ["model.preset=deepseek-v3-tiny"],
    "model.mtp": ["model.preset=deepseek-v3-tiny"],
    "train.batch_ramp": ["train.global_batch_size=8", "train.batch_ramp={start = 2, "
                         "increment = 2, samples = 100}"],
    "metrics.wandb": ['metrics.wandb={project = "p", mode = "offline"}'],
    "train.float8": ["model.ffn_hidden=128", "train.float8.recipe=rowwise"],
    "optim.muon": ["optim.name=muon", "optim.muon={lr = 0.02}"],
    "parallel.fault_tolerance": ["parallel.fault_tolerance={groups = 2, min_replicas = 1}"],
}  # fmt: skip


def test_the_table_keys_are_these():
    assert set(TABLE_KEYS) == set(WITH_TABLE)  # a new table key gets its cases here


def _table_of(config, key: str):
    section, name = key.split(".")
    return getattr(config.model if section == "model" else getattr(config, section), name)


def _takes_text(kind) -> bool:
    return kind is str or any(isinstance(a, str) or _takes_text(a) for a in typing.get_args(kind))


def test_every_field_of_every_table_key_with_every_odd_value():
    """Each field of each table key alone set to zero, negative, huge, non-finite, a wrong type,
    odd text, over a config with the table and one without: one line naming the table key's
    field, or the table with that field changed and every other kept. A value TOML reads
    (and a field that takes no text keeps as TOML reads it) gives the verdict of the table
    written out whole with it."""
    for key, cls in TABLE_KEYS.items():
        hints = typing.get_type_hints(cls)
        for with_table in (True, False):
            base = [*BASE, *(WITH_TABLE[key] if with_table else [])]
            before = _table_of(load_config(None, base), key)
            whole = dataclasses.asdict(before) if before is not None else {}
            for name in (f.name for f in dataclasses.fields(cls)):
                for value in ODD_TEXTS + NUMBERS:
                    message = _load_and_check([*base, f"{key}.{name}={value}"])
                    if message is not None:
                        assert message.startswith(key) or f"{name}=" in message, (key, value)
                        if with_table:  # the field at fault (or the one it breaks a relation of)
                            assert re.search(rf"\b{name}\b", message), message
                    else:
                        after = _table_of(load_config(None, [*base, f"{key}.{name}={value}"]), key)
                        kept = {k: v for k, v in dataclasses.asdict(after).items() if k != name}
                        assert kept == {k: v for k, v in whole.items() if k != name} or not whole
                    if with_table and not _takes_text(hints[name]) and _literal(value):
                        table = {k: _toml(v) for k, v in whole.items() if v is not None}
                        table[name] = value
                        written = "{" + ", ".join(f"{k} = {v}" for k, v in table.items()) + "}"
                        assert message == _load_and_check([*base, f"{key}={written}"]), value


def _literal(text: str) -> bool:
    try:
        tomllib.loads(f"v = {text}")
    except tomllib.TOMLDecodeError:
        return False
    return True


def test_data_path_from_the_file_with_phases_on_the_command_line_says_how_to_unset_it(repo):
    """hp-train's one line says how to unset the file's data.path; the advice, followed, is
    taken."""
    from tests.helpers.train import hp_train_here

    example = str(repo / "examples" / "train_tiny.toml")  # names data.path
    phases = 'data.phases=[{from_step = 1, path = "out/docstrings"}]'
    done = hp_train_here("--config", example, phases)
    assert done.returncode == 2 and len(done.stderr.splitlines()) == 1, done.stderr
    message = done.stderr.strip()
    assert message.startswith("hp-train: error: data.path: not with data.phases")
    assert "unset it with data.path=none" in message
    advice = message.split("unset it with ", 1)[1].split(" ")[0]
    config = load_config(example, [phases, advice])
    assert config.data.path is None and config.data.phases[0].path == "out/docstrings"


def test_the_config_modules_import_downwards():
    """The package's modules import only those below them (schema.py and messages.py at the
    bottom, load.py on top, writer.py on schema.py alone): no circle, and each concern reads
    with only what is under it."""
    import ast
    import pathlib

    import hp_runtime.train.config as package

    level = {"schema": 0, "messages": 0, "ranges": 1, "checks": 1, "paths": 1, "writer": 1}
    level |= {"values": 2, "load": 3}
    imports = {}
    for path in pathlib.Path(package.__file__).parent.glob("*.py"):
        nodes = ast.walk(ast.parse(path.read_text()))
        modules = [n.module for n in nodes if isinstance(n, ast.ImportFrom) and n.module]
        imports[path.stem] = {
            m.rpartition(".")[2] for m in modules if m.startswith("hp_runtime.train.config.")
        }
    assert set(imports) == {"__init__", *level}  # a new module gets its level here
    for name, below in imports.items():
        if name != "__init__":
            assert all(level[b] < level[name] for b in below), (name, below)
    assert imports["writer"] == {"schema"}
