"""`hp-train blame RUN_DIR --step N`: every sample step N trained on, down to the raw records.

The run's data position is one integer: step N trained the global samples
`[samples_after(N - 1), samples_after(N))` of its train split, in megatron-core's order, on any
layout. Each sample is mapped to the documents and tokens it is cut from
(`hp_data.provenance.sample_pieces`, through blends and phases), and each document to the raw
input record it came from (`document_source`: `file:line` of a JSONL, a Parquet row, an HF
dataset's index), from the provenance `hp-data preprocess` records beside a corpus; a corpus
without it (a Megatron-made one) gives document ids and no source. Nothing is trained and no
rank is started — except with `--losses`, which replays step N on one process from the
checkpoint before it (`hp-train replay --dump`) for each sample's loss.
"""

from __future__ import annotations

import json
import os
import tempfile
from typing import Any

from hp_data.errors import HpDataError
from hp_data.provenance import document_input, document_source, sample_pieces, source_text

from hp_runtime.train.batch import batch_plan
from hp_runtime.train.config import Config, load_config
from hp_runtime.train.data import check_data, resolve_data
from hp_runtime.train.errors import TrainError
from hp_runtime.train.plot import read_records
from hp_runtime.train.replicas import skipped_ranges

TEXT_CHARS = 80  # of each record's text in the table


def run_config(run_dir: str, overrides: list[str] = ()) -> Config:  # type: ignore[assignment]
    path = os.path.join(run_dir, "config.toml")
    if not os.path.isfile(path):
        raise TrainError(f"{run_dir}: no config.toml here: give a hp-train run directory")
    return load_config(path, list(overrides))


def train_split(config: Config) -> Any:
    """The run's train split as it trained on it, built in this process from its config (the
    index cache it wrote is loaded, not rebuilt)."""
    return check_data(resolve_data(config, batch_plan(config), validation=False)).build("train")


def step_samples(config: Config, step: int) -> range:
    """The global sample ids step `step` trained on."""
    if not 1 <= step <= config.train.steps:
        raise TrainError(f"--step {step}: the run trains steps 1 to {config.train.steps}")
    plan = batch_plan(config)
    return range(plan.samples_after(step - 1), plan.samples_after(step))


def blame(run_dir: str, step: int, losses: dict[int, dict[str, Any]] | None = None) -> dict:
    """The stable report: `{"step": N, "samples": [{"index": I, "pieces": [{"corpus",
    "document", "tokens": [START, END], "source"}]}]}` (`loss` on each sample when `losses`,
    from `hp-train replay --dump`, gives it; `missing_group` on each sample that a replica
    group missing from the step left untrained)."""
    config = run_config(run_dir)
    ids = step_samples(config, step)
    if config.data.type == "dummy":
        raise TrainError("data.type = 'dummy': its samples are random tokens, from no corpus")
    dataset = train_split(config)
    untrained = untrained_samples(run_dir, config, step)
    samples = []
    for index in ids:
        pieces = sample_pieces(dataset, index)
        for corpus in {p["corpus"] for p in pieces}:  # one lookup a corpus
            own = [p for p in pieces if p["corpus"] == corpus]
            found = document_source(corpus, [p["document"] for p in own])
            for piece, source in zip(own, found, strict=True):
                piece["source"] = source
        sample: dict[str, Any] = {"index": index, "pieces": pieces}
        if losses is not None and index in losses:
            sample["loss"] = losses[index]["loss"]
        if index in untrained:
            sample["missing_group"] = untrained[index]
        samples.append(sample)
    return {"step": step, "samples": samples}


def untrained_samples(run_dir: str, config: Config, step: int) -> dict[int, int]:
    """The samples of step `step` that no group trained, each with the replica group whose
    share it was (`parallel.fault_tolerance`: the run's `replicas` record of the step)."""
    ft = config.parallel.fault_tolerance
    if ft is None or not os.path.isfile(os.path.join(run_dir, "metrics.jsonl")):
        return {}
    missing = [g for r in read_records(run_dir) if r.get("kind") == "replicas"
               and r.get("step") == step for g in r["missing"]]  # fmt: skip
    plan = batch_plan(config)
    micro_batches = plan.accumulation_at(step)
    first, mbs, dp = plan.samples_after(step - 1), plan.micro_batch_size, plan.dp_size
    return {
        i: group
        for group in set(missing)
        for start, end in skipped_ranges(first, micro_batches, mbs, dp, ft.groups, group)
        for i in range(start, end)
    }


def _text(piece: dict[str, Any]) -> str:
    source = piece["source"]
    if source is None:
        return ""
    entry = document_input(piece["corpus"], piece["document"]) or {}
    try:
        key, split = entry.get("key", "text"), entry.get("split", "train")
        text = source_text(source, TEXT_CHARS, key, split)
    except (OSError, ValueError, HpDataError) as exc:  # the raw file moved since: say so
        return f"(cannot read it: {exc})"
    return " ".join(text.split())


def _where(source: dict[str, Any] | None) -> str:
    if source is None:
        return "(no provenance)"
    if "line" in source:
        return f"{source['file']}:{source['line']}"
    if "row" in source:
        return f"{source['file']} row {source['row']}"
    return f"{source['dataset']}[{source['index']}]"


def table(report: dict[str, Any]) -> str:
    """The report for a terminal: a line a piece, with the first characters of its record."""
    lines = [f"step {report['step']}: {len(report['samples'])} samples"]
    for sample in report["samples"]:
        loss = f" loss {sample['loss']:.4f}" if "loss" in sample else ""
        if "missing_group" in sample:
            loss += f" (not trained: replica group {sample['missing_group']} was missing)"
        lines.append(f"sample {sample['index']}{loss}")
        for piece in sample["pieces"]:
            start, end = piece["tokens"]
            lines.append(
                f"  {os.path.basename(piece['corpus'])} document {piece['document']} tokens "
                f"{start}-{end}  {_where(piece['source'])}  {_text(piece)}".rstrip()
            )
    return "\n".join(lines)


def sample_losses(run_dir: str, step: int, runtime: Any) -> dict[int, dict[str, Any]]:
    """Each sample's loss at step `step`: the step replayed on one process (`replay --dump`)."""
    from hp_runtime.train.replay import replay
    from hp_runtime.train.verify import one_process

    config = run_config(run_dir)
    overrides = one_process(batch_plan(config).global_batch_size, runtime.device.type)
    with tempfile.TemporaryDirectory(prefix="blame-") as dump:
        with open(os.devnull, "w") as quiet:
            replay(run_dir, step, overrides, runtime, dump, stream=quiet)
        with open(os.path.join(dump, f"step-{step:07d}.json")) as handle:
            dumped = json.load(handle)
    return {s["index"]: s for s in dumped["samples"]}
