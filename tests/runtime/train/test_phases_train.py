"""`[[data.phases]]` in hp-train: resume inside a phase and across a boundary as the run that
never stopped, reshard, add a phase to a finished run, refuse one inserted before the
checkpoint, refuse bad phases in one line, and `hp-train mix-report` against a hand count."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.helpers.corpus import largest_error, write_documents
from tests.helpers.train import FAST, hp_train_here, train_ranks

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def corpora(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("phase-corpora")
    sizes = {"big": 300, "other": 200, "small": 20}
    return {
        n: write_documents(str(root / n), count, 250, k)
        for k, (n, count) in enumerate(sizes.items())
    }


def _phases(*entries: tuple[int, str] | tuple[int, str, int]) -> str:
    items = []
    for entry in entries:
        length = f", seq_length = {entry[2]}" if len(entry) > 2 else ""
        items.append(f'{{from_step = {entry[0]}, path = "{entry[1]}"{length}}}')
    return "data.phases=[" + ", ".join(items) + "]"


def _three(c: dict[str, str]) -> str:
    """Steps 1-3 a blend, 4-5 another corpus at twice the length, 6- the small one again."""
    return _phases((1, f"0.5 {c['big']} 0.5 {c['small']}"), (4, c["other"], 32), (6, c["small"]))


def _base(c: dict[str, str], run: Path, *more: str) -> list[str]:
    return [
        "data.type=megatron", "data.seq_length=16", "data.split=1,0,0", "model.max_seq_len=32",
        "model.vocab_size=256", "train.global_batch_size=2", f"data.cache_dir={run.parent / 'c'}",
        f"train.run_dir={run}", *more,
    ]  # fmt: skip


@pytest.fixture(scope="module")
def full(corpora, tmp_path_factory) -> dict:
    """7 steps over three phases on one rank, checkpoints at 2, 4, 6 and 7."""
    run = tmp_path_factory.mktemp("full") / "run"
    result = train_ranks(1, [*_base(corpora, run), _three(corpora), "train.steps=7",
                             "checkpoint.interval=2"])[0]  # fmt: skip
    return {"run": run, "losses": result["losses"]}


@pytest.mark.parametrize("step", [2, 4])
def test_resume_inside_a_phase_and_across_boundaries_is_identical(corpora, full, tmp_path, step):
    """From step 2 (inside the blend, crossing both boundaries) and step 4 (inside the longer
    phase): the same losses as the run that never stopped."""
    resume = f"checkpoint.resume={full['run'] / 'checkpoints' / f'step-{step:07d}'}"
    again = train_ranks(1, [*_base(corpora, tmp_path / "run"), _three(corpora),
                            "train.steps=7", resume])[0]  # fmt: skip
    assert f"resumed from {full['run']}" in again["log"]
    assert again["losses"] == full["losses"][step:]


def test_a_two_rank_run_resumes_on_one_with_the_same_samples(corpora, full, tmp_path):
    two = tmp_path / "two"
    first = train_ranks(2, [*_base(corpora, two), _three(corpora), "train.steps=7",
                            "parallel.dp_shard=2", "checkpoint.interval=3"])  # fmt: skip
    np.testing.assert_allclose(first[0]["losses"], full["losses"], rtol=1e-5)
    resume = f"checkpoint.resume={two / 'checkpoints' / 'step-0000003'}"
    one = train_ranks(1, [*_base(corpora, tmp_path / "one"), _three(corpora), "train.steps=7",
                          resume])[0]  # fmt: skip
    np.testing.assert_allclose(one["losses"], first[0]["losses"][3:], rtol=1e-5)


def test_a_phase_added_to_a_finished_run_keeps_the_earlier_samples(corpora, full, tmp_path):
    from hp_runtime.train import load_config
    from hp_runtime.train.batch import batch_plan
    from hp_runtime.train.data import resolve_data

    added = _phases(
        (1, f"0.5 {corpora['big']} 0.5 {corpora['small']}"), (4, corpora["other"], 32),
        (6, corpora["small"]), (8, corpora["big"], 32),
    )  # fmt: skip
    old = load_config(None, [*_base(corpora, full["run"]), _three(corpora), "train.steps=7"])
    new = load_config(None, [*_base(corpora, full["run"]), added, "train.steps=9"])
    a = resolve_data(old, batch_plan(old), validation=False).build("train")
    b = resolve_data(new, batch_plan(new), validation=False).build("train")
    assert len(a) == 14 and len(b) == 18
    for i in range(14):
        np.testing.assert_array_equal(a[i]["tokens"], b[i]["tokens"])
    assert b[14]["tokens"].shape == (32,)
    resume = f"checkpoint.resume={full['run'] / 'checkpoints' / 'step-0000007'}"
    done = train_ranks(1, [*_base(corpora, tmp_path / "run"), added, "train.steps=9", resume])
    assert "resumed from" in done[0]["log"] and len(done[0]["losses"]) == 2


def test_a_phase_inserted_before_the_checkpoint_is_refused(corpora, full, tmp_path):
    inserted = _phases(
        (1, f"0.5 {corpora['big']} 0.5 {corpora['small']}"), (3, corpora["big"]),
        (4, corpora["other"], 32), (6, corpora["small"]),
    )  # fmt: skip
    resume = f"checkpoint.resume={full['run'] / 'checkpoints' / 'step-0000004'}"
    args = [*FAST, *_base(corpora, tmp_path / "run"), inserted, "train.steps=7", resume]
    done = hp_train_here(*args)
    assert done.returncode == 1 and len(done.stderr.splitlines()) == 1, done.stderr
    assert "data.phases[1] (from step 3" in done.stderr and "step 4" in done.stderr
    assert "checkpoint.allow_data_change" in done.stderr
    anyway = hp_train_here(*args, "checkpoint.allow_data_change=true")
    assert anyway.returncode == 0, anyway.stderr
    assert "warning: data.phases[1]" in anyway.stdout and "resumed from" in anyway.stdout


def _refusal(overrides: list[str]) -> str:
    from hp_runtime.train.batch import batch_plan, phase_starts
    from hp_runtime.train.config import check_paths, load_config
    from hp_runtime.train.errors import ConfigError

    with pytest.raises(ConfigError) as info:  # what `hp-train` checks before any rank works
        config = load_config(None, overrides)
        check_paths(config)
        phase_starts(config, batch_plan(config))
    message = str(info.value)
    assert "\n" not in message and "Traceback" not in message
    return message


def test_bad_phases_are_one_line_each(corpora, tmp_path):
    base = _base(corpora, tmp_path / "run", "train.steps=9")
    big = corpora["big"]
    cases = {
        "data.phases=5": "data.phases: expected an array of tables",
        "data.phases=[1, 2]": "data.phases: expected an array of tables",
        'data.phases=[{from_step = 0, path = "x"}]': "data.phases[0].from_step: must be",
        'data.phases=[{from_step = "1", path = "x"}]': "data.phases[0].from_step: expected",
        'data.phases=[{from_step = 1.5, path = "x"}]': "data.phases[0].from_step: expected",
        'data.phases=[{from_tokens = -3, path = "x"}]': "data.phases[0].from_tokens: must be",
        'data.phases=[{path = "x"}]': "data.phases[0].from_step: is needed",
        'data.phases=[{from_step = 1, from_tokens = 0, path = "x"}]': "data.phases[0].from_tokens",
        "data.phases=[{from_step = 1}]": "data.phases[0].path: required",
        "data.phases=[{from_step = 1, path = 3}]": "data.phases[0].path: expected a string",
        f'data.phases=[{{from_step = 1, pth = "{big}"}}]': "did you mean data.phases[0].path?",
        f'data.phases=[{{from_step = 2, path = "{big}"}}]': "data.phases[0].from_step: the first",
        f'data.phases=[{{from_step = 1, path = "{big}"}}, {{from_step = 5, path = "{big}"}}, '
        f'{{from_step = 4, path = "{big}"}}]': "data.phases[2].from_step: starts at step 4",
        f'data.phases=[{{from_step = 1, path = "{big}", seq_length = 64}}]': (
            "data.phases[0].seq_length=64 is longer than model.max_seq_len=32"
        ),
        f'data.phases=[{{from_step = 1, path = "{big}", seq_length = 1}}]': (
            "data.phases[0].seq_length: must be from 2"
        ),
        f'data.phases=[{{from_step = 1, path = "{big}"}}, {{from_step = 3, path = "/no/x"}}]': (
            "data.phases[1].path: '/no/x.idx': no such file"
        ),
        f'data.phases=[{{from_step = 1, path = "{big} {big}"}}]': "data.phases[0].path:",
    }
    for override, message in cases.items():
        assert message in _refusal([*base, override]), override
    phase = _phases((1, big))
    assert _refusal([*base, phase, f"data.path={big}"]).startswith("data.path: not with")
    assert "data.phases[0].seq_length=20 does not divide into 2 x parallel.cp" in _refusal(
        [*base, _phases((1, big, 20)), "parallel.cp=4"]
    )
    kind = _refusal([*base, phase, "data.type=json_file", "data.tokenizer=x", "data.path=y"])
    assert kind.startswith("data.phases: only with data.type = 'megatron'")


def test_mix_report_counts_as_the_hand_count(corpora, tmp_path):
    big, small = corpora["big"], corpora["small"]
    config = tmp_path / "run.toml"
    config.write_text(
        '[model]\npreset = "tiny"\nvocab_size = 256\nmax_seq_len = 32\n\n'
        f'[data]\ntype = "megatron"\nseq_length = 16\nsplit = "1,0,0"\n'
        f'cache_dir = "{tmp_path / "cache"}"\n\n'
        f'[[data.phases]]\nfrom_step = 1\npath = "3 {big} 1 {small}"\n\n'
        f'[[data.phases]]\nfrom_tokens = 800\npath = "{small}"\n\n'
        f'[train]\nsteps = 40\nglobal_batch_size = 2\nrun_dir = "{tmp_path / "run"}"\n'
    )
    done = hp_train_here("mix-report", "--config", config, "--json")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    # 800 tokens = 50 samples of 16 = steps 1-25; then 15 steps x 2 of small alone
    picks = largest_error([0.75, 0.25], 50)
    zero, one = report["phases"]
    assert (zero["from_step"], zero["to_step"], one["from_step"]) == (1, 25, 26)
    assert [s["samples"] for s in zero["streams"]] == [picks.count(0), picks.count(1)]
    assert one["streams"][0]["first_sample"] == picks.count(1)
    from hp_data.gpt import GPTDatasetConfig, epoch_samples

    size = epoch_samples(small, "train", GPTDatasetConfig(seq_length=16, split="1,0,0"))
    demand = picks.count(1) + 30
    stream = report["streams"][1]
    assert (stream["samples"], stream["epoch_samples"]) == (demand, size)
    assert stream["repeats"] == demand - size > 0 and stream["epochs"] == -(-demand // size)
    # small's sample `size` opens epoch 1: in phase 1 at its (size - picks.count(1))-th sample
    assert stream["wraps"][0]["step"] == 26 + (size - picks.count(1)) // 2
    table = hp_train_here("mix-report", "--config", config)
    assert table.returncode == 0 and f"epoch 1 at step {stream['wraps'][0]['step']}" in table.stdout
    assert not (tmp_path / "run").exists()  # a report trains nothing and makes no run
    # the command as a user runs it: a bad config is one line, exit 2, no traceback
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(ROOT / "packages/hp-data/src"), str(ROOT / "packages/hp-runtime/src")])}  # fmt: skip
    bad = subprocess.run(
        [sys.executable, "-m", "hp_runtime.train", "mix-report", "--config", str(config),
         'data.phases=[{from_step = 3, path = "x"}]'],
        capture_output=True, text=True, env=env, timeout=120,
    )  # fmt: skip
    assert bad.returncode == 2 and len(bad.stderr.splitlines()) == 1, bad.stderr
    assert bad.stderr.startswith("hp-train: error: data.phases[0].path: 'x.idx': no such file")
