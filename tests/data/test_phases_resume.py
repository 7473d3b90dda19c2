"""What a phased checkpoint's state compares on resume (`state_change`): a corpus rewritten
behind a phase's prefix since the checkpoint is named, though every count still agrees."""

from __future__ import annotations

import numpy as np
from hp_data.gpt import GPTDatasetConfig
from hp_data.phases import Phase, plan_phases, state_change

from tests.helpers.corpus import write_documents


def test_a_corpus_rewritten_since_the_checkpoint_is_named(tmp_path):
    a, b = (write_documents(str(tmp_path / n), 200, 250, k) for k, n in enumerate("ab"))
    config = GPTDatasetConfig(seq_length=16, split="1,0,0", cache_dir=str(tmp_path / "cache"))
    phases = [Phase(from_step=1, path=f"0.5 {a} 0.5 {b}"), Phase(from_step=4, path=b)]
    cumulative = np.arange(8, dtype=np.int64) * 4
    saved = plan_phases(phases, config, cumulative).state_at(5, 20)
    assert state_change(saved, plan_phases(phases, config, cumulative).state_at(5, 20), 5) is None
    write_documents(a, 200, 250, 9)  # other documents, the same prefix
    now = plan_phases(phases, config, cumulative).state_at(5, 20)
    assert [s["consumed"] for s in now["streams"]] == [s["consumed"] for s in saved["streams"]]
    assert state_change(saved, now, 5) == (
        f"the corpus {a} at seq_length 16 changed since the checkpoint's step 5"
    )
