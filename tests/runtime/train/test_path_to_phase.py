"""Issue 40: a run trained with `data.path = X` resumes with `data.phases = [{from_step = 1,
path = X}]`, the same stream of samples (docs/datasets.md: a single phase within one epoch is
exactly `build_split`'s samples), as the run that never stopped; a phase that reads other data
is still refused in one line."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.corpus import write_documents
from tests.helpers.train import FAST, hp_train_here, records, train_ranks


@pytest.fixture(scope="module")
def corpora(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("path-to-phase")
    return {n: write_documents(str(root / n), count, 250, k)
            for k, (n, count) in enumerate({"big": 300, "other": 200}.items())}  # fmt: skip


def _blend(c: dict[str, str], a: float = 0.7) -> str:
    return f"{a} {c['big']} {round(1 - a, 3)} {c['other']}"


def _phase(path: str) -> str:
    return f'data.phases=[{{from_step = 1, path = "{path}"}}]'


def _base(run: Path, steps: int, *more: str) -> list[str]:
    return [
        "data.type=megatron", "data.seq_length=16", "data.split=1,0,0", "model.vocab_size=256",
        "train.global_batch_size=2", f"data.cache_dir={run.parent / 'cache'}",
        f"train.run_dir={run}", f"train.steps={steps}", *more,
        "optim.decay_steps=6",  # each step's rate whatever train.steps: a 3-step run's are 6's
    ]  # fmt: skip


@pytest.fixture(scope="module")
def reference(corpora, tmp_path_factory) -> dict:
    """6 uninterrupted steps of `data.path`, and a run of its first 3 steps to resume."""
    root = tmp_path_factory.mktemp("reference")
    path = f"data.path={_blend(corpora)}"
    whole = train_ranks(1, _base(root / "whole", 6, path))[0]
    half = train_ranks(1, _base(root / "half", 3, path, "checkpoint.interval=3"))[0]
    assert half["losses"] == whole["losses"][:3]
    return {"losses": whole["losses"], "half": root / "half"}


def test_a_single_phase_run_trains_the_data_path_runs_samples(corpora, reference, tmp_path):
    """The premise, checked: a fresh run of the one phase gives the data.path run's losses."""
    fresh = train_ranks(1, _base(tmp_path / "run", 6, _phase(_blend(corpora))))[0]
    assert fresh["losses"] == reference["losses"]
    assert len(fresh["losses"]) == 6


def test_a_data_path_run_resumes_as_its_single_phase_bit_exactly(corpora, reference, tmp_path):
    run = tmp_path / "run"
    seed = f"checkpoint.resume={reference['half'] / 'checkpoints' / 'step-0000003'}"
    again = train_ranks(1, _base(run, 6, _phase(_blend(corpora)), seed))[0]
    assert f"resumed from {reference['half']}" in again["log"]
    assert again["losses"] == reference["losses"][3:]


@pytest.mark.parametrize(
    ("phase", "named"),
    [
        (lambda c: _blend(c, 0.5), "data.phases[0]"),  # the same corpora, other weights
        (lambda c: c["big"], "data.phases[0]"),  # another path
    ],
)
def test_a_phase_reading_other_data_is_still_refused(corpora, reference, tmp_path, phase, named):
    seed = f"checkpoint.resume={reference['half'] / 'checkpoints' / 'step-0000003'}"
    done = hp_train_here(*FAST, *_base(tmp_path / "run", 6, _phase(phase(corpora)), seed))
    assert done.returncode == 1, done.stdout
    assert len(done.stderr.splitlines()) == 1, done.stderr
    assert named in done.stderr and "it reads other corpora or weights" in done.stderr
    assert "keep data.path = " in done.stderr and "checkpoint.allow_data_change" in done.stderr


def test_a_data_path_run_past_one_epoch_is_refused_saying_why(tmp_path):
    """Past one epoch the streams differ (a GPTDataset of two epochs shuffles them together, a
    phase each on its own): seen in the losses of two fresh runs, so the resume is refused,
    in one line that says so and what to do."""
    few = write_documents(str(tmp_path / "few"), 6, 250, 7)  # 10 samples of 16 tokens
    path = tmp_path / "path"
    done = hp_train_here(*FAST, *_base(path, 8, f"data.path={few}", "checkpoint.interval=2"))
    assert done.returncode == 0, done.stderr
    phase = hp_train_here(*FAST, *_base(tmp_path / "phase", 8, _phase(few)))
    assert phase.returncode == 0, phase.stderr
    losses = [[r["loss"] for r in records(run)] for run in (path, tmp_path / "phase")]
    assert len(losses[0]) == len(losses[1]) == 8 and losses[0] != losses[1]
    seed = f"checkpoint.resume={path / 'checkpoints' / 'step-0000002'}"
    refused = hp_train_here(*FAST, *_base(tmp_path / "run", 8, _phase(few), seed))
    assert refused.returncode == 1 and len(refused.stderr.splitlines()) == 1, refused.stderr
    assert "data.phases[0] (path" in refused.stderr and "past its one epoch of" in refused.stderr
    assert f"keep data.path = '{few}' to resume" in refused.stderr
