"""metrics.wandb in offline mode: the W&B run holds the same train and validation values as
metrics.jsonl, step by step, and a resumed run continues the same W&B run. The run file is
read back here in W&B's own record format (the LevelDB-style log of `wandb_internal`
protobuf records that `wandb sync` uploads), independently of hp's code."""

from __future__ import annotations

import json
import struct

import pytest

from tests.helpers.train import FAST, hp_train_here, records

wandb = pytest.importorskip("wandb")

RUN = [*FAST, "data.type=dummy", "data.seq_length=16", "train.eval_interval=3",
       "train.eval_iters=1", "checkpoint.interval=3",
       'metrics.wandb={project = "hp-test", mode = "offline"}']  # fmt: skip


def _history(run_file) -> list[dict]:
    """The history rows of a .wandb file: a 7-byte header, then 32 KiB blocks of records
    (crc32, length, type; a record may span blocks: FIRST, MIDDLE, LAST)."""
    from wandb.proto import wandb_internal_pb2 as pb

    raw, block = run_file.read_bytes(), 32768
    assert raw[:4] == b":W&B"
    pos, pieces, rows = 7, b"", []
    while pos + 7 <= len(raw):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", raw[pos : pos + 7])
        pieces += raw[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL or LAST: one record
            record = pb.Record()
            record.ParseFromString(pieces)
            pieces = b""
            if record.WhichOneof("record_type") == "history":
                items = record.history.item
                rows.append(
                    {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in items}
                )
    return rows


def test_offline_run_has_the_logged_values(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_SILENT", "true")
    run = tmp_path / "run"
    assert hp_train_here(*RUN, "train.steps=3", f"train.run_dir={run}").returncode == 0
    assert hp_train_here(*RUN, "train.steps=4", f"train.run_dir={run}").returncode == 0
    files = sorted((run / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(files) == 2 and len({f.name for f in files}) == 1  # the resume: the same W&B run
    rows = [row for f in files for row in _history(f)]
    trains = {r["step"]: r for r in records(run, "train")}
    logged = {row["_step"]: row for row in rows if "loss" in row}
    assert sorted(logged) == [1, 2, 3, 4] == sorted(trains)
    for step, row in logged.items():
        for key in ("loss", "grad_norm", "lr", "consumed_samples", "tokens_per_s"):
            assert row[key] == pytest.approx(trains[step][key], rel=1e-12), (step, key)
    validation = {r["step"]: r["val_loss"] for r in records(run, "validation")}
    assert {row["_step"]: row["val_loss"] for row in rows if "val_loss" in row} == validation


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ('{mode = "offline"}', "metrics.wandb.project: required"),
        ('{project = "p", mode = "sometimes"}', "metrics.wandb.mode: expected one of"),
        ('{project = "p", entity = "me"}', "metrics.wandb.entity: unknown field"),
        ('"p"', "metrics.wandb: expected a table {project, name, mode}"),
    ],
)
def test_bad_wandb_tables_are_one_line(tmp_path, value, message):
    done = hp_train_here(*FAST, "data.type=dummy", "data.seq_length=16", "train.steps=1",
                         f"metrics.wandb={value}", f"train.run_dir={tmp_path}")  # fmt: skip
    assert done.returncode == 2
    assert done.stderr.strip().startswith(f"hp-train: error: {message}"), done.stderr
    assert len(done.stderr.strip().splitlines()) == 1
