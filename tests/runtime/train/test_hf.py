"""Hugging Face Llama in and out, checked against transformers' own model."""

from __future__ import annotations

import copy
import errno
import json
import os
import re
import shutil
import stat
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from hp_runtime.model import ModelConfig
from hp_runtime.model.config import RopeScaling

from tests.helpers.distributed import run_ranks
from tests.helpers.train import FAST, hp_train, hp_train_here

transformers = pytest.importorskip("transformers")

SHAPE = {
    "vocab_size": 256,
    "dim": 64,
    "n_layers": 2,
    "n_heads": 4,
    "n_kv_heads": 2,
    "ffn_hidden": 172,
    "max_seq_len": 64,
}
TOKENS = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(5))


def _hf_llama(directory, tied: bool, qk_std: float = 0.05, **fields) -> np.ndarray:
    """A random HF Llama saved to `directory` (LlamaConfig `fields` added); its logits on
    TOKENS. A larger `qk_std` sharpens attention, so that positions show in the logits."""
    torch.manual_seed(11)
    config = transformers.LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=172, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        rms_norm_eps=1e-5, tie_word_embeddings=tied,
        **{"rope_theta": 10000.0, **copy.deepcopy(fields)},  # transformers edits the dicts
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(config)
    for name, param in model.named_parameters():  # norms start at 1: make them count too
        std = qk_std if re.search(r"\.[qk]_proj\.", name) else 0.05
        torch.nn.init.normal_(param, std=0.2 if param.ndim == 1 else std)
    model.save_pretrained(directory)
    with torch.no_grad():
        return model(TOKENS).logits.numpy()


def _hp_logits(
    rank: int, world: int, directory: str, tied: bool, fields: dict | None = None
) -> np.ndarray:
    from hp_runtime.model import ModelConfig
    from hp_runtime.parallel import ParallelDims, assemble
    from hp_runtime.train.hf import init_from_hf

    config = ModelConfig(**SHAPE, tie_embeddings=tied, **(fields or {}))
    assembly = assemble(config, ParallelDims(tp=world), torch.device("cpu"), seed=0)
    init_from_hf(assembly.modules, config, directory)
    with torch.no_grad():
        return assembly.model(TOKENS).numpy()


@pytest.mark.slow
@pytest.mark.parametrize("tied", [False, True])
def test_init_from_an_hf_llama_gives_its_logits(tmp_path, tied):
    reference = _hf_llama(tmp_path, tied)
    single = run_ranks(_hp_logits, 1, str(tmp_path), tied)[0]
    np.testing.assert_allclose(single, reference, atol=1e-4, rtol=0)
    for logits in run_ranks(_hp_logits, 2, str(tmp_path), tied):  # tensor parallel
        np.testing.assert_allclose(logits, reference, atol=1e-4, rtol=0)


# Llama 3.1's scaling on a tiny model: at theta 500 head_dim 16's wavelengths run from 6 to
# 1,330, against 32 / 4 and 32 / 1, so some frequencies are kept, some interpolated and some
# slowed 8 times, all within TOKENS' 24 positions.
HF_SCALED = {
    "rope_theta": 500.0,
    "rope_scaling": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32,
    },
}  # fmt: skip
HP_SCALED = {"rope_theta": 500.0, "rope_scaling": RopeScaling("llama3", 8.0, 1.0, 4.0, 32)}


@pytest.mark.slow
def test_init_from_a_scaled_hf_llama_gives_its_logits(tmp_path):
    reference = _hf_llama(tmp_path / "scaled", tied=False, qk_std=0.3, **HF_SCALED)
    plain = _hf_llama(tmp_path / "plain", tied=False, qk_std=0.3, rope_theta=500.0)
    assert np.abs(reference - plain).max() > 0.01  # same weights: the scaling shows, 100x 1e-4
    for world in (1, 2):  # one process, tensor parallel
        for logits in run_ranks(_hp_logits, world, str(tmp_path / "scaled"), False, HP_SCALED):
            np.testing.assert_allclose(logits, reference, atol=1e-4, rtol=0)


def test_an_export_with_rope_scaling_gives_transformers_the_same_logits(tmp_path):
    """hp's model, written by export's writer, read by transformers (5 reads rope_parameters;
    rope_scaling is what 4 reads), and back by init_from as the same config."""
    from hp_runtime.model import Transformer
    from hp_runtime.train.hf import model_config_from_hf, write_hf

    config = ModelConfig(**SHAPE, **HP_SCALED)
    torch.manual_seed(4)
    model = Transformer(config)
    for param in model.parameters():
        torch.nn.init.normal_(param, std=0.2 if param.ndim == 1 else 0.05)
    out = tmp_path / "hf"
    write_hf({n: p.detach() for n, p in model.named_parameters()}, config, str(out), "float32")
    written = json.loads((out / "config.json").read_text())
    assert written["rope_scaling"] == HF_SCALED["rope_scaling"]
    assert written["rope_parameters"] == {**HF_SCALED["rope_scaling"], "rope_theta": 500.0}
    hf = transformers.LlamaForCausalLM.from_pretrained(out)
    assert hf.config.rope_parameters["rope_type"] == "llama3"
    with torch.no_grad():
        expected = model(TOKENS).numpy()
        np.testing.assert_allclose(hf(TOKENS).logits.numpy(), expected, atol=1e-4, rtol=0)
    assert ModelConfig(**model_config_from_hf(str(out))) == config


def test_init_from_checks_rope_scaling_as_it_checks_rope_theta(tmp_path):
    from hp_runtime.train.hf import check_hf_config
    from hp_runtime.train.launch import TrainError

    hf = {
        "vocab_size": 256, "hidden_size": 64, "intermediate_size": 172, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64,
        "rms_norm_eps": 1e-5, **HF_SCALED,
    }  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(hf))
    scaled = ModelConfig(**SHAPE, **HP_SCALED)
    check_hf_config(scaled, str(tmp_path))
    table = (
        '{type = "llama3", factor = 8.0, low_freq_factor = 1.0, high_freq_factor = 4.0, '
        "original_max_seq_len = 32}"
    )
    slower = RopeScaling("llama3", 4.0, 1.0, 4.0, 32)
    cases = {
        ModelConfig(**SHAPE, rope_theta=500.0): '"none"',
        ModelConfig(**SHAPE, rope_theta=500.0, rope_scaling=slower): table.replace("8.0", "4.0"),
    }
    for config, have in cases.items():
        with pytest.raises(TrainError) as error:
            check_hf_config(config, str(tmp_path))
        assert str(error.value) == (
            f"model.init_from: {tmp_path} has rope_scaling={table}, the config "
            f"model.rope_scaling={have}; set model.rope_scaling = {table}"
        )
    hf.pop("rope_scaling")  # a checkpoint without scaling into a config with it
    (tmp_path / "config.json").write_text(json.dumps(hf))
    with pytest.raises(
        TrainError, match='has rope_scaling="none", the config model.rope_scaling={type'
    ):
        check_hf_config(scaled, str(tmp_path))


@pytest.mark.parametrize("bias", ["attention_bias", "mlp_bias"])
def test_a_transformers_checkpoint_with_biases_is_refused_by_name(tmp_path, bias):
    """Saved by transformers itself; the config.json names the bias, and without it (edited
    by hand, or another converter's) the bias tensors are named: no bias is ever dropped."""
    from hp_runtime.model import Transformer
    from hp_runtime.train.hf import init_from_hf
    from hp_runtime.train.launch import TrainError

    _hf_llama(tmp_path, tied=False, **{bias: True})
    config = ModelConfig(**SHAPE)
    model = Transformer(config)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(TrainError) as error:
        init_from_hf([model], config, str(tmp_path))
    assert str(error.value) == (
        f"{tmp_path / 'config.json'}: {bias}=true is not supported; hp's Llama has "
        f"{bias}=false only"
    )
    hf = json.loads((tmp_path / "config.json").read_text())
    del hf[bias]
    (tmp_path / "config.json").write_text(json.dumps(hf))
    with pytest.raises(TrainError) as error:
        init_from_hf([model], config, str(tmp_path))
    first = "self_attn.k_proj" if bias == "attention_bias" else "mlp.down_proj"
    assert str(error.value).startswith(
        f"model.init_from: {tmp_path} has tensors hp's Llama has no place for: "
        f"model.layers.0.{first}.bias, "
    )
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())  # untouched


def _checkpoint_logits(directory: str) -> np.ndarray:
    import tomllib

    import torch.distributed.checkpoint as dcp
    from hp_runtime.model import Transformer
    from hp_runtime.train.checkpoint_format import read_meta
    from hp_runtime.train.config import build_config

    config = build_config(tomllib.loads(read_meta(directory)["config"])).model
    model = Transformer(config)
    state = {name: torch.empty_like(p) for name, p in model.named_parameters()}
    dcp.load({"model": state}, checkpoint_id=directory, no_dist=True)
    model.load_state_dict(state, strict=False)
    model.tie_weights()
    with torch.no_grad():
        return model(TOKENS).numpy()


@pytest.mark.slow
def test_an_export_over_a_previous_one_loads_in_transformers(tiny_run, tmp_path):
    checkpoint = tiny_run / "checkpoints" / "step-0000003"  # tied: no lm_head in the export
    out = tmp_path / "hf"
    out.mkdir(mode=0o750)  # an empty directory is written, its permissions kept
    first = _export(checkpoint, out, "--max-shard-size", "50KB")
    assert first.exit_code == 0, first.stderr
    assert (out / "model.safetensors.index.json").exists()
    done = hp_train("export", checkpoint, "--out", out, "--dtype", "float32")  # as users run it
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""
    assert sorted(os.listdir(out)) == ["config.json", "hp-export.json", "model.safetensors"]
    assert stat.S_IMODE(out.stat().st_mode) == 0o750
    assert os.listdir(tmp_path) == ["hf"]  # nothing hidden left beside it
    model = transformers.LlamaForCausalLM.from_pretrained(out)
    names = {name for name, _ in model.named_parameters()}
    assert "model.layers.1.self_attn.q_proj.weight" in names
    with torch.no_grad():
        hf = model(TOKENS).logits.numpy()
    np.testing.assert_allclose(hf, _checkpoint_logits(str(checkpoint)), atol=1e-4, rtol=0)


def _export(checkpoint, out, *args: str):
    from hp_runtime.train.cli import export_command

    return CliRunner().invoke(export_command, [str(checkpoint), "--out", str(out), *args])


def _tree(root: Path) -> dict[str, bytes | None]:
    """Every path under `root` (hidden ones too), with a file's bytes."""
    found: dict[str, bytes | None] = {}
    for path in sorted(root.rglob("*")):
        found[str(path.relative_to(root))] = path.read_bytes() if path.is_file() else None
    return found


def test_export_never_writes_over_what_it_did_not_write(tiny_run, tmp_path, monkeypatch):
    checkpoint = tiny_run / "checkpoints" / "step-0000003"
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("mine")
    (tmp_path / "file.txt").write_text("a file")
    (tmp_path / "forged").mkdir()  # a manifest that claims a file outside it
    (tmp_path / "forged" / "config.json").write_text("{}")
    manifest = {"written_by": "hp-train export", "files": ["config.json", "../file.txt"]}
    (tmp_path / "forged" / "hp-export.json").write_text(json.dumps(manifest))
    garbled = {"list": "[1]", "string": '"x"', "files": '{"files": 3}', "null": "null",
               "count": '{"written_by": "hp-train export", "files": 3}'}  # fmt: skip
    for name, text in garbled.items():  # valid JSON, but not a manifest
        (tmp_path / f"garbled-{name}").mkdir()
        (tmp_path / f"garbled-{name}" / "config.json").write_text("{}")
        (tmp_path / f"garbled-{name}" / "hp-export.json").write_text(text)
    (tmp_path / "added").mkdir()  # a previous export a user added a file to
    assert _export(checkpoint, tmp_path / "added").exit_code == 0
    (tmp_path / "added" / "tokenizer.json").write_text("{}")
    monkeypatch.chdir(tmp_path)
    not_ours = "is a non-empty directory that is not an hp-train export; give a new or empty "
    not_ours += "directory (export never deletes files it did not write)"
    cases = {
        str(tiny_run): not_ours,  # the run directory: every checkpoint and metrics.jsonl
        "mine": not_ours,
        ".": "is the current directory; give a directory inside it, such as ./hf-model",
        "forged": not_ours,
        **{f"garbled-{name}": not_ours for name in garbled},
        "added": "holds tokenizer.json, which hp-train export did not write; move it out or "
        "give another directory",
        "file.txt": "is a file, not a directory; give a new or empty directory",
        "no/hf": f"{tmp_path / 'no'} does not exist; create it first",
        "file.txt/hf": f"{tmp_path / 'file.txt'} is not a directory; create it first",
    }
    run_before, here_before = _tree(tiny_run.parent), _tree(tmp_path)
    for out, message in cases.items():
        done = _export(checkpoint, out)
        assert done.exit_code == 1, out
        assert done.stderr.splitlines() == [f"hp-train: error: --out {out}: {message}"]
    assert _tree(tiny_run.parent) == run_before
    assert _tree(tmp_path) == here_before
    if os.geteuid() != 0:  # root writes anywhere
        (tmp_path / "locked").mkdir(mode=0o555)
        done = _export(checkpoint, "locked/hf")
        assert done.stderr.splitlines() == [
            f"hp-train: error: --out locked/hf: cannot write in {tmp_path / 'locked'} "
            "(permission denied)"
        ]


def _checkpoint_tensors(directory: Path) -> tuple[dict[str, torch.Tensor], ModelConfig]:
    import tomllib

    import torch.distributed.checkpoint as dcp
    from hp_runtime.model import Transformer
    from hp_runtime.train.checkpoint_format import read_meta
    from hp_runtime.train.config import build_config

    config = build_config(tomllib.loads(read_meta(str(directory))["config"])).model
    with torch.device("meta"):
        model = Transformer(config)
    state = {n: torch.empty(p.shape) for n, p in model.named_parameters()}
    dcp.load({"model": state}, checkpoint_id=str(directory), no_dist=True)
    return state, config


def test_a_killed_export_leaves_the_old_export_or_the_new(tiny_run, tmp_path):
    """A real SIGKILL before each filesystem step of an export (tests/helpers/kill_anywhere)."""
    from hp_runtime.train import export_output
    from hp_runtime.train.hf import write_hf

    from tests.helpers.kill_anywhere import _in_child

    tensors, config = _checkpoint_tensors(tiny_run / "checkpoints" / "step-0000003")
    out = tmp_path / "hf"
    points = [(export_output, "_exchange"), (os, "rmdir")]

    def job(shard_bytes: int):
        return lambda: write_hf(tensors, config, str(out), "float32", shard_bytes) and None

    def hidden() -> dict[str, bytes | None]:
        return {k: v for k, v in _tree(tmp_path).items() if k.startswith(".")}

    assert not _in_child(job(150_000), None)  # the new export: 2 shards and an index
    new = _tree(out)
    shutil.rmtree(out)
    assert not _in_child(job(10**9), None)  # the old: one model.safetensors
    old = _tree(out)

    def restore(state: dict[str, bytes | None] | None) -> None:
        """`out` as `state` (None: absent), and nothing hidden beside it."""
        for name in os.listdir(tmp_path):
            if name.startswith(".") or name == "hf":
                shutil.rmtree(tmp_path / name)
        if state is not None:
            out.mkdir()
            for name, data in state.items():
                (out / name).write_bytes(data)

    for before in (old, None):
        restore(before)
        for step in range(1, 100):
            killed = _in_child(job(150_000), step, points)
            assert (_tree(out) if out.exists() else None) in (before, new), (before, step)
            for name in hidden():  # a kill's leftovers: export files in a hidden directory
                assert re.fullmatch(r"\.hf\.export-(old-)?\w+(/hf)?(/[\w.-]+)?", name), name
            assert not _in_child(job(150_000), None)  # a rerun completes it
            assert _tree(out) == new
            restore(before)
            if not killed:
                break
        assert step > 10, step  # the staging, each file's fsync, the swap, the removal


def test_an_export_replaces_the_previous_one_without_rename_exchange(
    tiny_run, tmp_path, monkeypatch
):
    """On a filesystem without RENAME_EXCHANGE (NFS) the previous export is renamed aside."""
    from hp_runtime.train import export_output

    checkpoint = tiny_run / "checkpoints" / "step-0000003"
    assert _export(checkpoint, tmp_path / "hf", "--max-shard-size", "50KB").exit_code == 0

    def unsupported(a: str, b: str) -> None:
        raise OSError(errno.EINVAL, "Invalid argument")

    monkeypatch.setattr(export_output, "_exchange", unsupported)
    done = _export(checkpoint, tmp_path / "hf")
    assert done.exit_code == 0, done.stderr
    assert sorted(os.listdir(tmp_path / "hf")) == [
        "config.json", "hp-export.json", "model.safetensors",
    ]  # fmt: skip
    assert os.listdir(tmp_path) == ["hf"]


def test_export_errors_are_one_line(tmp_path):
    done = hp_train("export", tmp_path / "nothing", "--out", tmp_path / "hf")
    assert done.returncode == 1
    assert done.stderr.splitlines() == [
        f"hp-train: error: {tmp_path / 'nothing' / 'meta.json'}: missing; "
        f"{tmp_path / 'nothing'} is not a hp-train checkpoint"
    ]
    assert not (tmp_path / "hf").exists()
    size = hp_train("export", tmp_path, "--out", tmp_path / "hf", "--max-shard-size", "5 GBs")
    assert size.returncode == 1
    assert size.stderr.splitlines() == [
        "hp-train: error: --max-shard-size '5 GBs': give a positive size such as 5GB or 500MiB"
    ]


def test_export_reads_only_the_stored_model_config(tiny_run, tmp_path):
    """A run's other keys may be out of today's ranges or renamed since: export needs only
    [model], and writes what it writes from the untouched checkpoint."""
    shutil.copytree(tiny_run / "checkpoints" / "step-0000003", tmp_path / "old")
    file = tmp_path / "old" / "meta.json"
    meta = json.loads(file.read_text())
    meta.pop("xxh3")  # its self-checksum: gone, rather than stale
    assert "# decay_steps = (none)\n" in meta["config"]
    meta["config"] = meta["config"].replace("# decay_steps = (none)\n", "decay_steps = 0\n")
    meta["config"] = meta["config"].replace("[train]\n", "[train]\nlr_warmup = 3\n")  # renamed
    file.write_text(json.dumps(meta))
    for name, checkpoint in (
        ("new", tiny_run / "checkpoints" / "step-0000003"),
        ("old", file.parent),
    ):
        done = hp_train_here("export", checkpoint, "--out", tmp_path / f"hf-{name}")
        assert done.returncode == 0, done.stderr
    assert _tree(tmp_path / "hf-old") == _tree(tmp_path / "hf-new")


@pytest.mark.slow
def test_a_run_starts_from_an_hf_directory(tmp_path):
    _hf_llama(tmp_path / "hf", tied=False)
    shape = [f"model.{k}={v}" for k, v in SHAPE.items()]
    run = tmp_path / "run"
    done = hp_train_here(
        *FAST, *shape, "data.type=dummy", "data.seq_length=24", "train.steps=2",
        f"model.init_from={tmp_path / 'hf'}", f"train.run_dir={run}",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert f"initialised from {tmp_path / 'hf'}" in done.stdout
    assert f"hp-train: {ModelConfig(**SHAPE).num_params():,} parameters | " in done.stdout
    wrong = hp_train_here(
        *FAST, *shape, "model.dim=32", "model.ffn_hidden=86", "data.type=dummy",
        "data.seq_length=24", "train.steps=2", f"model.init_from={tmp_path / 'hf'}",
        f"train.run_dir={tmp_path / 'wrong'}",
    )  # fmt: skip
    assert wrong.returncode == 1
    assert "has dim=64, the config model.dim=32; set model.dim = 64" in wrong.stderr


@pytest.fixture(scope="module")
def hf_reference(tmp_path_factory) -> Path:
    """A random untied HF Llama of SHAPE, as transformers saves it. Read only."""
    directory = tmp_path_factory.mktemp("hf-reference")
    _hf_llama(directory, tied=False)
    return directory


WANT = {
    **SHAPE, "rope_theta": 10000.0, "rope_scaling": None, "norm_eps": 1e-5,
    "tie_embeddings": False, "qk_norm": False, "moe": None,
}  # fmt: skip
# Published configs (meta-llama/Llama-2-7b-hf, meta-llama/Meta-Llama-3-8B), as on the Hub.
LLAMA_2 = {
    "_name_or_path": "meta-llama/Llama-2-7b-hf", "architectures": ["LlamaForCausalLM"],
    "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu", "hidden_size": 4096,
    "initializer_range": 0.02, "intermediate_size": 11008, "max_position_embeddings": 4096,
    "model_type": "llama", "num_attention_heads": 32, "num_hidden_layers": 32,
    "num_key_value_heads": 32, "pretraining_tp": 1, "rms_norm_eps": 1e-05, "rope_scaling": None,
    "tie_word_embeddings": False, "torch_dtype": "float16",
    "transformers_version": "4.31.0.dev0", "use_cache": True, "vocab_size": 32000,
}  # fmt: skip
LLAMA_3 = {
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 128000, "eos_token_id": 128001, "hidden_act": "silu", "hidden_size": 4096,
    "initializer_range": 0.02, "intermediate_size": 14336, "max_position_embeddings": 8192,
    "model_type": "llama", "num_attention_heads": 32, "num_hidden_layers": 32,
    "num_key_value_heads": 8, "pretraining_tp": 1, "rms_norm_eps": 1e-05, "rope_scaling": None,
    "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "transformers_version": "4.40.0.dev0", "use_cache": True, "vocab_size": 128256,
}  # fmt: skip


def _read_config(tmp_path: Path, config: object) -> dict:
    from hp_runtime.train.hf import model_config_from_hf

    (tmp_path / "config.json").write_text(json.dumps(config))
    return model_config_from_hf(str(tmp_path))


def test_init_from_reads_what_transformers_writes(hf_reference, tmp_path):
    from hp_runtime.train.hf import model_config_from_hf

    assert model_config_from_hf(str(hf_reference)) == WANT
    shape = {
        "vocab_size": 256, "hidden_size": 64, "intermediate_size": 172, "num_hidden_layers": 2,
        "num_attention_heads": 4,
    }  # fmt: skip
    full = transformers.LlamaConfig(
        **shape, num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5
    ).to_dict()  # every field LlamaConfig holds, bookkeeping included, at its defaults
    assert _read_config(tmp_path, full) == WANT
    # what transformers assumes for the fields a config leaves out
    ref = transformers.LlamaConfig(**shape)
    theta = ref.rope_parameters["rope_theta"] if getattr(ref, "rope_parameters", None) else None
    assert _read_config(tmp_path, shape) == {
        "vocab_size": 256, "dim": 64, "ffn_hidden": 172, "n_layers": 2, "n_heads": 4,
        "n_kv_heads": ref.num_key_value_heads, "max_seq_len": ref.max_position_embeddings,
        "rope_theta": theta or ref.rope_theta, "rope_scaling": None,
        "norm_eps": ref.rms_norm_eps, "tie_embeddings": ref.tie_word_embeddings,
        "qk_norm": False, "moe": None,
    }  # fmt: skip
    assert _read_config(tmp_path, LLAMA_2)["n_kv_heads"] == 32
    assert _read_config(tmp_path, LLAMA_3)["rope_theta"] == 500000.0


NOT_FALSE = "is not supported; hp's Llama has {0}=false only"
LLAMA_31_ROPE = {
    "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192, "rope_type": "llama3",
}  # fmt: skip


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"attention_bias": True}, "attention_bias=true " + NOT_FALSE.format("attention_bias")),
        ({"mlp_bias": True}, "mlp_bias=true " + NOT_FALSE.format("mlp_bias")),
        ({"hidden_act": "gelu"}, 'hidden_act="gelu" is not supported; hp\'s Llama has '
         'hidden_act="silu" only'),
        ({"attention_dropout": 0.1}, "attention_dropout=0.1 is not supported; hp's Llama has "
         "attention_dropout=0.0 only"),
        ({"pretraining_tp": 2}, "pretraining_tp=2 is not supported; hp's Llama has "
         "pretraining_tp=1 only"),
        ({"model_type": "mistral"}, 'model_type="mistral" is not supported; hp reads "llama", '
         '"qwen3", "mixtral", "qwen3_moe", "dots1", "glm4_moe", "deepseek_v3"'),
        ({"architectures": ["LlamaForSequenceClassification"]},
         'architectures=["LlamaForSequenceClassification"]; hp loads LlamaForCausalLM'),
        ({"rope_scaling": LLAMA_31_ROPE}, "rope_parameters and rope_scaling disagree; give one "
         "scaling"),
        ({"rope_parameters": {**LLAMA_31_ROPE, "factor": 0.5}},
         "rope_parameters.factor=0.5 must be at least 1"),
        ({"rope_parameters": {**LLAMA_31_ROPE, "factor": "8"}},
         'rope_parameters.factor="8" must be a number'),
        ({"rope_parameters": {**LLAMA_31_ROPE, "low_freq_factor": True}},
         "rope_parameters.low_freq_factor=true must be a number"),
        ({"rope_parameters": {**LLAMA_31_ROPE, "low_freq_factor": 0}},
         "rope_parameters.low_freq_factor=0.0 must be more than 0"),
        ({"rope_parameters": {**LLAMA_31_ROPE, "high_freq_factor": 1.0}},
         "rope_parameters.high_freq_factor=1.0 must be more than low_freq_factor=1.0"),
        ({"rope_parameters": {**LLAMA_31_ROPE, "original_max_position_embeddings": 8192.0}},
         "rope_parameters.original_max_position_embeddings=8192.0 must be an integer"),
        ({"rope_parameters": {**LLAMA_31_ROPE, "original_max_position_embeddings": 0}},
         "rope_parameters.original_max_position_embeddings=0 must be at least 1"),
        ({"rope_parameters": {"rope_type": "llama3", "factor": 8.0}},
         'rope_parameters.low_freq_factor is missing; rope_type "llama3" gives factor, '
         "low_freq_factor, high_freq_factor, original_max_position_embeddings"),
        ({"rope_parameters": {**LLAMA_31_ROPE, "attention_factor": 1.0}},
         'rope_parameters.attention_factor=1.0 is not supported (rope_type "llama3" takes '
         "rope_type, rope_theta, factor, low_freq_factor, high_freq_factor, "
         "original_max_position_embeddings)"),
        ({"rope_parameters": {**LLAMA_31_ROPE, "type": "linear"}},
         "rope_parameters.type and rope_parameters.rope_type disagree"),
        ({"rope_scaling": {**LLAMA_31_ROPE, "rope_type": "longrope"}},
         'rope_scaling.rope_type="longrope" is not supported; hp implements "default", '
         '"llama3" and "yarn"'),
        ({"rope_scaling": {**LLAMA_31_ROPE, "rope_type": "yarn"}},
         'rope_scaling.low_freq_factor=1.0 is not supported (rope_type "yarn" takes rope_type, '
         "rope_theta, factor, original_max_position_embeddings, beta_fast, beta_slow, mscale, "
         "mscale_all_dim, truncate)"),
        ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0}},
         'rope_parameters.original_max_position_embeddings is missing; rope_type "yarn" gives '
         "factor, original_max_position_embeddings"),
        ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "truncate": False,
                              "original_max_position_embeddings": 64}},
         "rope_parameters.truncate=false is not supported; hp's YaRN rounds its ramp's bounds "
         "outwards (truncate true)"),
        ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "beta_fast": 0.5,
                              "original_max_position_embeddings": 64}},
         "rope_parameters.beta_fast=0.5 must be at least beta_slow=1.0"),
        ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "mscale": -1,
                              "original_max_position_embeddings": 64}},
         "rope_parameters.mscale=-1.0 must be at least 0"),
        ({"rope_scaling": [LLAMA_31_ROPE]}, f"rope_scaling=[{json.dumps(LLAMA_31_ROPE)}] must "
         "be an object with a rope_type"),
        ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "factor": 2.0}},
         'rope_parameters.factor=2.0 is not supported (rope_type "default" takes rope_type, '
         "rope_theta)"),
        ({"rope_theta": 5e5, "rope_parameters": {"rope_type": "default", "rope_theta": 1e4}},
         "rope_theta=500000.0, rope_parameters.rope_theta=10000.0 disagree; give one rotary "
         "theta"),
        ({"head_dim": 7}, "head_dim=7 must be even for rotary"),
        ({"sliding_window": 4096}, "sliding_window is not a field hp's Llama implements; hp "
         "loads plain Llama models only"),
        ({"hidden_size": "64"}, 'hidden_size="64" must be a positive integer'),
        ({"num_hidden_layers": -1}, "num_hidden_layers=-1 must be a positive integer"),
        ({"num_attention_heads": True}, "num_attention_heads=true must be a positive integer"),
        ({"rms_norm_eps": "1e-5"}, 'rms_norm_eps="1e-5" must be a positive number'),
        ({"tie_word_embeddings": "yes"}, 'tie_word_embeddings="yes" must be true or false'),
        ({"vocab_size": None}, "vocab_size is missing; an HF Llama config.json gives it"),
        ({"num_key_value_heads": 3}, "num_attention_heads=4 is not a multiple of "
         "num_key_value_heads=3"),
    ],
)  # fmt: skip
def test_init_from_refuses_a_config_hp_cannot_represent(hf_reference, tmp_path, change, message):
    from hp_runtime.train.launch import TrainError

    config = json.loads((hf_reference / "config.json").read_text())
    config.update(change)
    config = {k: v for k, v in config.items() if v is not None or k == "pad_token_id"}
    with pytest.raises(TrainError) as error:
        _read_config(tmp_path, config)
    assert str(error.value) == f"{tmp_path / 'config.json'}: {message}"
    with pytest.raises(TrainError, match="not a JSON object"):
        _read_config(tmp_path, [config])


class _Hostile:
    """A pickle that, once loaded, leaves a file behind."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_init_from_takes_every_tensor_or_refuses_by_name(hf_reference, tmp_path):
    import pickle

    from hp_runtime.model import Transformer
    from hp_runtime.train.hf import init_from_hf
    from hp_runtime.train.launch import TrainError
    from safetensors.torch import load_file, save_file

    directory = tmp_path / "hf"
    shutil.copytree(hf_reference, directory)
    weights = load_file(directory / "model.safetensors")

    def init(tensors: dict[str, torch.Tensor] | None, tied: bool = False) -> str | None:
        if tensors is not None:
            save_file(tensors, directory / "model.safetensors")
        config = json.loads((hf_reference / "config.json").read_text())
        config["tie_word_embeddings"] = tied
        (directory / "config.json").write_text(json.dumps(config))
        shape = ModelConfig(**SHAPE, tie_embeddings=tied)
        model = Transformer(shape)
        try:
            init_from_hf([model], shape, str(directory))
        except TrainError as exc:
            return str(exc)
        wq = model.layers["1"].attention.wq.weight
        assert torch.equal(wq, weights["model.layers.1.self_attn.q_proj.weight"])
        return None

    unused = f"model.init_from: {directory} has tensors hp's Llama has no place for: "
    bias = {"model.layers.0.self_attn.q_proj.bias": torch.zeros(64)}
    assert init({**weights, **bias}) == unused + "model.layers.0.self_attn.q_proj.bias"
    # the rotary frequencies older transformers saved, computed as they did: nothing new
    hd = SHAPE["dim"] // SHAPE["n_heads"]

    def inv_freq(theta: float) -> dict[str, torch.Tensor]:
        freq = 1.0 / (theta ** (torch.arange(0, hd, 2, dtype=torch.int64).float() / hd))
        return {f"model.layers.{i}.self_attn.rotary_emb.inv_freq": freq.clone() for i in range(2)}

    assert init({**weights, **inv_freq(10000.0)}) is None
    assert init({**weights, **inv_freq(5e5)}) == unused + (
        "model.layers.0.self_attn.rotary_emb.inv_freq, model.layers.1.self_attn.rotary_emb.inv_freq"
    )
    # tied: an lm_head.weight only if it is the embedding
    assert init(weights, tied=True) == (
        f"model.init_from: {directory} has an lm_head.weight that differs from "
        "model.embed_tokens.weight, but its config ties them (tie_word_embeddings)"
    )
    copy = {**weights, "lm_head.weight": weights["model.embed_tokens.weight"].clone()}
    assert init(copy, tied=True) is None
    # a pickle is never loaded: beside safetensors it is ignored, alone it is refused
    sentinel = tmp_path / "unpickled"
    with open(directory / "pytorch_model.bin", "wb") as stream:
        pickle.dump({"model.embed_tokens.weight": _Hostile(sentinel)}, stream)
    assert init(weights) is None
    (directory / "model.safetensors").unlink()
    assert init(None) == (
        f"{directory}: holds pytorch_model.bin (a pickle, which hp never loads) and no "
        "*.safetensors; convert it to safetensors first, e.g. with transformers' "
        "from_pretrained(...).save_pretrained(...) on a machine you trust it on"
    )
    assert not sentinel.exists()
    index = {"weight_map": {"lm_head.weight": "model-00001-of-00002.safetensors"}}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))
    assert init(None) == (
        f"{directory / 'model.safetensors.index.json'}: names "
        f"model-00001-of-00002.safetensors, which {directory} does not hold"
    )
