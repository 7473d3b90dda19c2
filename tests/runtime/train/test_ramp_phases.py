"""`train.batch_ramp` with `[[data.phases]]` (issue 24 §2 with §3): a phase's first sample is
counted from the batch plan, so a resume whose ramp would count another number of samples up
to the checkpoint would start the later phases at other steps than the run's: refused in one
line (a plain run resumes: test_batch_ramp.py)."""

from __future__ import annotations

import json

import pytest

from tests.helpers.corpus import write_documents
from tests.helpers.train import FAST, hp_train_here


@pytest.fixture(scope="module")
def corpora(tmp_path_factory) -> list[str]:
    root = tmp_path_factory.mktemp("ramp-phases")
    return [write_documents(str(root / n), 120, 250, k) for k, n in enumerate("ab")]


def _args(run, cache, *more: str) -> list[str]:
    return [*FAST, "data.type=megatron", "data.seq_length=16", "data.split=1,0,0",
            "model.vocab_size=256", "train.global_batch_size=4",
            f"data.cache_dir={cache}", f"train.run_dir={run}", *more]  # fmt: skip


def test_a_finished_ramp_removed_with_phases_is_refused(corpora, tmp_path):
    """The ramp [2, 2, 8] trains 2, 2, 2, 2 samples, then 4: step 5 ends at 12 samples, where
    the run without the ramp would be at 20. Phase 1 starts at step 6: at sample 12 + 4 = 16
    in the run, at 20 in a plan without the ramp (its step 6 would read phase 0 again)."""
    a, b = corpora
    phases = f'data.phases=[{{from_step=1, path="{a}"}}, {{from_step=6, path="{b}"}}]'
    run, cache = tmp_path / "run", tmp_path / "cache"
    first = [phases, "train.batch_ramp=[2,2,8]", "train.steps=5", "checkpoint.interval=5"]
    done = hp_train_here(*_args(run, cache, *first))
    assert done.returncode == 0, done.stderr
    meta = json.loads((run / "checkpoints" / "step-0000005" / "meta.json").read_text())
    assert meta["consumed_samples"] == 12  # 4 x 2 + 4, counted by hand
    resume = f"checkpoint.resume={run / 'checkpoints' / 'step-0000005'}"
    again = hp_train_here(
        *_args(tmp_path / "again", cache, phases, "train.batch_ramp=none", "train.steps=6", resume)
    )
    lines = again.stderr.strip().splitlines()
    assert again.returncode == 1 and len(lines) == 1 and "Traceback" not in again.stderr, lines
    assert "train.batch_ramp changed from [2, 2, 8] to none" in lines[0]
    assert "data.phases" in lines[0] and "20 samples up to step 5" in lines[0]
    assert (run / "checkpoints" / "step-0000005").is_dir()
