"""Issue 40: `hp-train mix-report` of a run whose `data.phases` URLs carry a credential. The
run's config.toml has it redacted, so the report comes from what the run recorded
(RUN_DIR/mix-report.json), with no request to the store; where the record does not answer
the question (overrides), one line says how to give the credential."""

from __future__ import annotations

import json

import pytest

from tests.helpers.corpus import largest_error, write_documents
from tests.helpers.fault_http import Faults, fault_server
from tests.helpers.train import FAST, hp_train_here

SECRET = "reader:s3cret-Pa55"


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """Two corpora behind a server that answers only the credential: (server, URL base)."""
    root = tmp_path_factory.mktemp("store")
    write_documents(str(root / "big"), 300, 250, 0)
    write_documents(str(root / "other"), 200, 250, 1)
    with fault_server(root, Faults(auth=SECRET)) as server:
        yield server, f"http://{SECRET}@127.0.0.1:{server.server_address[1]}"


def _args(base: str, run, steps: int = 3) -> list[str]:
    phases = f'data.phases=[{{from_step = 1, path = "0.75 {base}/big 0.25 {base}/other"}}]'
    return [
        "data.type=megatron", "data.seq_length=16", "data.split=1,0,0", "model.vocab_size=256",
        "train.global_batch_size=4", f"data.cache_dir={run.parent / 'cache'}",
        f"train.run_dir={run}", f"train.steps={steps}", phases,
    ]  # fmt: skip


@pytest.fixture(scope="module")
def run(store, tmp_path_factory):
    """A 3-step run over the store, and the report of its config with the credential."""
    _, base = store
    run = tmp_path_factory.mktemp("mix") / "run"
    done = hp_train_here(*FAST, *_args(base, run))
    assert done.returncode == 0, done.stderr
    assert SECRET not in (run / "config.toml").read_text()
    told = hp_train_here("mix-report", "--json", *FAST, *_args(base, run))
    assert told.returncode == 0, told.stderr
    return run, json.loads(told.stdout)


def test_the_report_with_the_credential_is_the_hand_count(run):
    _, report = run
    picks = largest_error([0.75, 0.25], 12)  # 3 steps of 4 samples
    assert [s["samples"] for s in report["phases"][0]["streams"]] == [
        picks.count(0),
        picks.count(1),
    ]
    assert SECRET not in json.dumps(report)


@pytest.mark.parametrize("how", ["run_dir", "config"])
def test_the_runs_redacted_config_reports_from_its_record(store, run, how):
    server, _ = store
    run_dir, want = run
    asked = len(server.requests)
    given = [run_dir] if how == "run_dir" else ["--config", run_dir / "config.toml"]
    done = hp_train_here("mix-report", *given, "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == want
    assert len(server.requests) == asked  # nothing asked of the store: no credential needed
    table = hp_train_here("mix-report", *given)
    assert table.returncode == 0 and table.stdout.startswith("3 steps, 12 samples, 192 tokens")


def test_what_the_record_cannot_answer_says_how_to_give_the_credential(store, run):
    run_dir, _ = run
    done = hp_train_here("mix-report", "--config", run_dir / "config.toml", "train.steps=5")
    assert done.returncode == 2 and done.stdout == ""
    assert len(done.stderr.splitlines()) == 1, done.stderr
    line = done.stderr
    assert line.startswith("hp-train: error: data.phases[0].path: ")
    assert "redacted" in line and "environment" in line and "Traceback" not in line
    assert SECRET.split(":")[1] not in line


def test_a_run_directory_without_a_record_is_one_line(tmp_path):
    done = hp_train_here("mix-report", tmp_path)
    assert done.returncode == 1 and len(done.stderr.splitlines()) == 1, done.stderr
    assert done.stderr.startswith(f"hp-train: error: {tmp_path}: no mix-report.json here")
