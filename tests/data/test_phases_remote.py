"""Phases over URL prefixes (issue 24 §1 with §2): what a checkpoint records of a URL phase is
read through the run's own store options (its cache directory, its request timeout), never
the defaults."""

from __future__ import annotations

import tempfile

import numpy as np
from hp_data import remote
from hp_data.gpt import GPTDatasetConfig
from hp_data.phases import Phase, plan_phases

from tests.helpers.object_store import CHUNK_MB, upload_memory, write_corpus


def test_the_state_of_url_phases_reads_through_the_runs_cache_and_timeout(tmp_path, monkeypatch):
    """`state_at` (what every checkpoint saves) fingerprints each stream's corpus: for a URL
    prefix through `data.cache_dir` and `data.remote_timeout_s`, not a default cache in the
    temporary directory nor the default 60 s for every later request of the process."""
    upload_memory("state", {n: write_corpus(tmp_path / n, k, count=60) for k, n in enumerate("ab")})
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))  # the default cache's home
    config = GPTDatasetConfig(seq_length=16, split="1,0,0", cache_dir=str(tmp_path / "cache"),
                              remote_chunk_mb=CHUNK_MB, remote_timeout_s=5.0)  # fmt: skip
    phases = [
        Phase(from_step=1, path="memory://state/a"),
        Phase(from_step=3, path="memory://state/b"),
    ]
    try:
        plan = plan_phases(phases, config, np.arange(6, dtype=np.int64) * 4)
        state = plan.state_at(4, 16)
        assert remote._timeout == 5.0
    finally:
        remote.set_timeout(remote.DEFAULT_TIMEOUT)
    assert [s["consumed"] for s in state["streams"]] == [8, 8]  # 2 steps of 4 each
    assert not (tmp_path / "tmp").exists()  # nothing fetched into a cache the run did not name
    assert len(list((tmp_path / "cache" / "remote").iterdir())) == 2  # both corpora, its own
