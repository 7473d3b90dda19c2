"""A URL prefix read by DataLoader workers (`data.num_workers`, 1 by default on a multi-core
machine): a store that stops serving mid-run (403: the credentials expired) ends hp-train in
one line naming the object, as it does with
the reads in the main process; torch raises a worker's error again with the worker's
traceback as its text, which never reaches the user."""

from __future__ import annotations

from tests.helpers.fault_http import Faults, fault_server
from tests.helpers.object_store import CHUNK_MB, files_of, write_corpus
from tests.helpers.train import FAST, hp_train


def test_a_store_gone_under_a_dataloader_worker_is_one_line(tmp_path):
    served = tmp_path / "served"
    served.mkdir()
    for suffix, data in files_of(write_corpus(tmp_path / "a", 3)).items():
        (served / f"a{suffix}").write_bytes(data)
    # GETs 1 and 2 are the .idx and .hp.json the run copies at its start; the .bin's are refused
    with fault_server(served, Faults(status_on=dict.fromkeys(range(3, 500), 403))) as server:
        # The installed script, as users run it: its worker forks a fresh process, not pytest's
        # with the threads and state of every earlier test. A CI run saw the worker forked from
        # pytest's process segfault there after the run had ended (not reproduced alone).
        done = hp_train(
            *FAST, "data.num_workers=1", "data.type=megatron", f"data.path={server.url('a')}",
            "data.split=1,0,0", "data.seq_length=16", f"data.remote_chunk_mb={CHUNK_MB}",
            f"data.cache_dir={tmp_path / 'cache'}", "data.remote_timeout_s=2",
            "model.vocab_size=1000", "train.steps=2", f"train.run_dir={tmp_path / 'run'}",
            timeout=120,
        )  # fmt: skip
    errors = [line for line in done.stderr.splitlines() if line.startswith("hp-train: error")]
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    assert len(errors) == 1 and "worker" not in errors[0], done.stderr
    assert errors[0].startswith(f"hp-train: error: {server.url('a')}.bin: cannot read bytes ")
    assert "access denied" in errors[0]
