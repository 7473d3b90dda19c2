"""hp-train as users run it: the installed script and torchrun, on the shipped corpus."""

from __future__ import annotations

import re
import subprocess
import tomllib

import pytest
from hp_runtime.train.config import build_config, load_config

from tests.helpers.run import cli as hp_data
from tests.helpers.train import FAST, hp_train, hp_train_here, records, torchrun

EXAMPLE = "examples/train_tiny.toml"


@pytest.fixture(scope="module")
def prefix(tmp_path_factory, example_corpus, example_tokenizer):
    """The README's first step: the shipped corpus preprocessed by hp-data."""
    out = tmp_path_factory.mktemp("data") / "docstrings"
    done = hp_data(
        "preprocess",
        example_corpus,
        "--out",
        out,
        "--tokenizer",
        example_tokenizer,
        "--append-eod",
        "--quiet",
    )
    assert done.returncode == 0, done.stderr
    return out


def _overrides(prefix, run, *extra: str) -> list[str]:
    return [f"data.path={prefix}", f"train.run_dir={run}", "train.cpu_threads=1", *extra]


@pytest.mark.slow
def test_one_process_on_the_shipped_corpus(repo, prefix, tmp_path):
    run = tmp_path / "run"
    overrides = _overrides(
        prefix, run, "train.steps=40", "train.eval_interval=20", "metrics.log_interval=1"
    )
    done = hp_train("--config", EXAMPLE, *overrides, cwd=repo)
    assert done.returncode == 0, done.stderr
    losses = [r["loss"] for r in records(run)]
    assert len(losses) == 40
    assert losses[0] > 8.5  # ln(8192) = 9.01 from a fresh model
    assert sum(losses[-5:]) / 5 < losses[0] - 1.5
    assert [r["step"] for r in records(run, "validation")] == [20, 40]
    # the resolved config, written beside the outputs, is the config the run used
    written = build_config(tomllib.loads((run / "config.toml").read_text()))
    assert written == load_config(str(repo / EXAMPLE), overrides)
    assert (run / "metrics.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert any((run / "tensorboard").iterdir())
    assert "step 40/40" in done.stdout and "Traceback" not in done.stderr


@pytest.mark.slow
def test_fsdp2_under_torchrun(repo, prefix, tmp_path):
    run = tmp_path / "run"
    done = torchrun(
        2,
        "--config",
        EXAMPLE,
        *_overrides(
            prefix,
            run,
            "parallel.dp_shard=2",
            "train.steps=30",
            "train.eval_interval=0",
            "metrics.log_interval=1",
        ),
        cwd=repo,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    losses = [r["loss"] for r in records(run)]
    assert len(losses) == 30 and sum(losses[-5:]) / 5 < losses[0] - 1.0
    assert done.stdout.count("step 30/30") == 1  # rank 0 alone logs


@pytest.mark.slow
def test_a_preset_then_one_moe_field_trains_a_top_1_moe(repo, prefix, tmp_path):
    """`model.preset=moe-tiny model.moe.top_k=1` on the shipped example: the run's
    config.toml holds the preset's table with top_k 1, the model built from it routes each
    token to one expert, and the run counts one expert's parameters active a token."""
    from dataclasses import replace

    import torch
    from hp_runtime.model import PRESETS, Transformer

    run = tmp_path / "run"
    overrides = _overrides(
        prefix,
        run,
        "train.steps=2",
        "train.eval_interval=0",
        "metrics.log_interval=1",
        "model.preset=moe-tiny",
        "model.moe.top_k=1",
    )
    done = hp_train("--config", EXAMPLE, *overrides, cwd=repo)
    assert done.returncode == 0, done.stderr
    assert [r["step"] for r in records(run)] == [1, 2]
    written = tomllib.loads((run / "config.toml").read_text())["model"]
    expected = replace(PRESETS["moe-tiny"].moe, top_k=1)  # the preset's table, one field changed
    assert written["moe"] == {name: getattr(expected, name) for name in written["moe"]}
    assert set(written["moe"]) >= {"experts", "top_k", "expert_ffn_hidden"}
    model = build_config(tomllib.loads((run / "config.toml").read_text())).model
    chosen = []
    transformer = Transformer(model)
    for name, module in transformer.named_modules():
        if name.endswith("feed_forward.router"):
            module.register_forward_hook(lambda _, __, out: chosen.append(out[1]))
    transformer(torch.randint(0, model.vocab_size, (2, 16)))
    assert len(chosen) == model.n_layers and all(c.shape == (32, 1) for c in chosen)
    # One token's parameters, counted from the shapes: embeddings in and out, final norm; each
    # layer's attention (q, o: dim x dim; k, v: dim x kv width), two norms, the router and
    # its one expert's SwiGLU (3 x dim x expert_ffn_hidden).
    dim, kv = written["dim"], written["n_kv_heads"] * written["dim"] // written["n_heads"]
    experts, width = written["moe"]["experts"], written["moe"]["expert_ffn_hidden"]
    layer = 2 * dim * dim + 2 * dim * kv + 2 * dim + dim * experts + 1 * 3 * dim * width
    active = 2 * written["vocab_size"] * dim + dim + written["n_layers"] * layer
    assert re.search(rf"parameters \({active:,} active a token\)", done.stdout), done.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["optim.lr_warmup=5"], "optim.lr_warmup: unknown key; did you mean optim.warmup_steps?"),
        (["train.steps=many"], "train.steps: expected an integer, got 'many'"),
        (
            ["train.global_batch_size=12", "train.micro_batch_size=8"],
            "train.global_batch_size=12 is not a multiple of train.micro_batch_size",
        ),
        (["parallel.tp=2"], "world size is 1"),
        (["model.preset=moe-tiny", "model.moe.top_k=0"], "model.moe.top_k: must be from 1"),
        (["model.preset=moe-tiny", "model.moe.top_k=16"], "model.moe.top_k: is more than experts"),
        (["model.moe.topk=1"], "model.moe.topk: unknown field; did you mean model.moe.top_k? "
                               "its fields: experts, top_k, expert_ffn_hidden, shared_experts"),
        (["model.moe.top_k=1"], "model.moe.experts: required; model.moe needs experts, top_k"),
    ],
)  # fmt: skip
def test_config_errors_are_one_line(repo, tmp_path, args, message):
    done = hp_train("--config", EXAMPLE, f"train.run_dir={tmp_path / 'run'}", *args, cwd=repo)
    assert done.returncode == 2
    assert done.stderr.splitlines() == [f"hp-train: error: {done.stderr[17:].strip()}"]
    assert message in done.stderr
    assert not (tmp_path / "run").exists()  # stopped before any work


def _leftovers(marker: str) -> str:
    return subprocess.run(["pgrep", "-af", marker], capture_output=True, text=True).stdout


@pytest.mark.slow
@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["parallel.tp=4"],
            "dp_replicate*dp_shard*cp*tp*pp = 1*1*1*4*1 = 4, but the world size is 2",
        ),
        (
            ["parallel.dp_shard=2", "train.global_batch_size=3", "train.micro_batch_size=1"],
            "train.global_batch_size=3 is not a multiple of train.micro_batch_size x data-parallel "
            "size = 1 x 2 = 2",
        ),
    ],
)
def test_layout_errors_under_torchrun(repo, tmp_path, args, message):
    run = tmp_path / "layout-error-run"
    done = torchrun(2, "--config", EXAMPLE, f"train.run_dir={run}", *args, cwd=repo)
    assert done.returncode != 0
    ours = [line for line in done.stderr.splitlines() if line.startswith("hp-train: error:")]
    assert len(ours) == 1 and message in ours[0], done.stderr[-2000:]
    assert (
        "/hp_runtime/" not in done.stderr
    )  # no traceback through our code (torchrun adds its own report)
    assert not _leftovers(str(run))  # no rank left running


BAD = [
    "optim.decay_steps=0",
    "model.n_heads=0",
    "optim.lr=-1",
    "model.norm_eps=-1e-5",
    "train.steps=" + "1" + "0" * 30,
    "model.dim=1000000000000",
    "data.type=megatron",
    "optim.beta2=1",
    "checkpoint.resume=/nonexistent/step-1",
    "optim.wsd_decay_fraction=0.5",  # in range: this one trains
]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_drawn_bad_overrides_end_cleanly(tmp_path, seed):
    """A few bad values drawn by seed, as the installed script meets them: exit 0, 1 or 2,
    no traceback, the user's file in the run directory untouched, nothing left running."""
    import random

    from tests.helpers.train import FAST

    drawn = random.Random(seed).sample(BAD, 2)
    if seed == 2:
        drawn = ["optim.wsd_decay_fraction=0.5"]  # and one that runs to the end
    run = tmp_path / f"drawn-run-{seed}"
    run.mkdir()
    (run / "notes.txt").write_text("mine")
    base = ["data.type=dummy", "data.seq_length=16", "train.steps=2", f"train.run_dir={run}"]
    done = hp_train(*FAST, *base, *drawn, timeout=120)
    assert done.returncode in (0, 1, 2), done.stderr[-2000:]
    assert "Traceback" not in done.stderr, done.stderr[-2000:]
    if done.returncode:
        assert len(done.stderr.splitlines()) == 1, done.stderr
    assert (run / "notes.txt").read_text() == "mine"
    assert not _leftovers(str(run))


def test_a_missing_text_key_names_hp_trains_key(tmp_path, example_tokenizer):
    """A json_file record without data.text_key is reported with hp-train's key, not with
    hp-data's --json-keys flag (which an hp-train user never sets)."""
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text('{"text": "a first document"}\n{"body": "no text"}\n')
    done = hp_train_here(
        *FAST, "data.type=json_file", f"data.path={corpus}", f"data.tokenizer={example_tokenizer}",
        f"data.cache_dir={tmp_path / 'cache'}", "model.vocab_size=8192", "data.seq_length=8",
        "train.steps=1", f"train.run_dir={tmp_path / 'run'}",
    )  # fmt: skip
    assert done.returncode == 1
    assert done.stderr.splitlines() == [
        f"hp-train: error: data: {corpus}:2: missing key 'text' (choose keys with data.text_key)"
    ]


LAZY_FACE = """
import contextlib, io, sys
import hp_runtime.train as face
from hp_runtime.train.cli import main
listed = set(face.__all__) <= set(dir(face))
with contextlib.redirect_stdout(io.StringIO()) as out, contextlib.suppress(SystemExit):
    main(["--help"])
print(listed, "torch" in sys.modules, "Usage: hp-train" in out.getvalue())
face.ConfigError, face.train  # on first use, each from its module
print("torch" in sys.modules)
"""


def test_the_package_face_and_help_load_no_torch_until_a_name_is_used():
    """`hp-train --help` and `import hp_runtime.train` load no torch (PEP 562); dir() still
    lists the face's names, and using one imports it."""
    import sys

    done = subprocess.run([sys.executable, "-c", LAZY_FACE], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["True", "False", "True", "True"]


BAD_CONFIG = """
import contextlib, io, sys
import hp_runtime.model as model, hp_runtime.parallel as parallel
from hp_runtime.train.cli import main
err = io.StringIO()
with contextlib.redirect_stderr(err), contextlib.suppress(SystemExit):
    main(["--config", sys.argv[1], "model.attention=nope"])
print("torch" in sys.modules, err.getvalue().strip())
print(set(model.__all__) <= set(dir(model)), set(parallel.__all__) <= set(dir(parallel)))
import hp_runtime.parallel.assemble
print(parallel.assemble.__name__, type(parallel.assemble).__name__, model.Transformer.__name__)
"""


def test_a_bad_config_is_refused_before_torch_loads():
    """The config's types (the model's shape, the parallel dims) are torch-free and the model
    and parallel faces import on first use (PEP 562), so a bad key is one line in a fraction
    of a second; `parallel.assemble` stays the function once its submodule loads."""
    import sys

    done = subprocess.run(
        [sys.executable, "-c", BAD_CONFIG, "examples/train_tiny.toml"],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        "False hp-train: error: model.attention: expected one of 'auto', 'sdpa', 'flex', "
        "'segments', got 'nope'",
        "True True",
        "assemble function Transformer",
    ]
