"""`hp-train blame`: the samples of a step, down to the raw records. Checked against a
reconstruction from the raw JSONL files written here: each piece's line read from the file it
names, tokenized with `tokenizers` itself, cut to the piece's tokens, the pieces joined — the
sample's tokens as the run trained on them. Through preprocess with dedup and skipped invalid
lines, two inputs, shards and their merge, a blend and two data phases; a Megatron-made corpus
(no provenance) gives document ids only; `--losses` replays the step for each sample's loss."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from hp_data.pipeline import PreprocessOptions, preprocess
from hp_data.shards import merge_shards
from tokenizers import Tokenizer

from tests.helpers.train import FAST, hp_train_here, records

TOKENIZER = "examples/tokenizer.json"
EOD = 0  # the example tokenizer's end of document, appended by preprocess


def _lines(seed: int, count: int) -> list[str]:
    rng = np.random.default_rng(seed)
    words = ["alpha", "beta", "gamma", "delta", "data", "model", "token", "sample", "step"]
    return [json.dumps({"text": " ".join(rng.choice(words, rng.integers(5, 40)))})
            for _ in range(count)]  # fmt: skip


@pytest.fixture(scope="module")
def run(tmp_path_factory, repo):
    root = tmp_path_factory.mktemp("blame")
    first, second = _lines(1, 120), _lines(2, 80)
    second[5] = first[7]  # a duplicate across the inputs: dropped by --dedup
    second[9] = "{not json"  # an invalid line: skipped
    (root / "a1.jsonl").write_text("\n".join(first) + "\n")
    (root / "a2.jsonl").write_text("\n".join(second) + "\n")
    (root / "b.jsonl").write_text("\n".join(_lines(3, 150)) + "\n")
    options = dict(append_eod=True, workers=1, show_progress=False, tokenizer_engine="hf")
    tokenizer = str(repo / TOKENIZER)
    preprocess([str(root / "a1.jsonl"), str(root / "a2.jsonl")], str(root / "a"), tokenizer,
               PreprocessOptions(skip_invalid=True, dedup="exact", **options))  # fmt: skip
    for index in (0, 1):  # corpus b in two shards, merged
        shard = PreprocessOptions(num_shards=2, shard_index=index, units=4, **options)
        preprocess([str(root / "b.jsonl")], str(root / "b"), tokenizer, shard)
    merge_shards(str(root / "b"))
    run_dir = root / "run"
    done = hp_train_here(
        *FAST, "data.type=megatron", "data.seq_length=32", "model.vocab_size=8192",
        "train.steps=4", "train.global_batch_size=4", "checkpoint.interval=2",
        f'data.phases=[{{from_step = 1, path = "0.5 {root}/a 0.5 {root}/b"}}, '
        f'{{from_step = 4, path = "{root}/a"}}]',
        f"train.run_dir={run_dir}",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return run_dir


def _trained_tokens(run_dir, step: int) -> dict[int, np.ndarray]:
    """The tokens of step `step`'s samples as the run read them (its train split): the
    global samples 4 (step - 1) .. 4 step - 1, a global batch of 4 a step."""
    from hp_runtime.train.blame import run_config, train_split

    dataset = train_split(run_config(str(run_dir)))
    return {i: dataset[i]["tokens"] for i in range(4 * (step - 1), 4 * step)}


def _rebuilt(pieces: list[dict], tokenizer: Tokenizer) -> np.ndarray:
    out = []
    for piece in pieces:
        source = piece["source"]
        line = Path(source["file"]).read_text().splitlines()[source["line"] - 1]  # from 1
        ids = tokenizer.encode(json.loads(line)["text"], add_special_tokens=False).ids + [EOD]
        start, end = piece["tokens"]
        out.extend(ids[start:end])
    return np.array(out, dtype=np.int64)


@pytest.mark.parametrize("step", [2, 4])  # the blend of phase 1; corpus a alone in phase 2
def test_each_sample_is_its_raw_lines(run, repo, step):
    done = hp_train_here("blame", str(run), "--step", str(step), "--json")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    tokenizer = Tokenizer.from_file(str(repo / TOKENIZER))
    trained = _trained_tokens(run, step)
    assert report["step"] == step and [s["index"] for s in report["samples"]] == sorted(trained)
    corpora = set()
    for sample in report["samples"]:
        rebuilt = _rebuilt(sample["pieces"], tokenizer)
        # the sample's tokens are its first seq_length of the pieces' (the last is its label)
        np.testing.assert_array_equal(rebuilt[:32], trained[sample["index"]])
        corpora |= {p["corpus"].rsplit("/", 1)[1] for p in sample["pieces"]}
    assert corpora == ({"a", "b"} if step == 2 else {"a"})
    table = hp_train_here("blame", str(run), "--step", str(step)).stdout
    assert f"step {step}: 4 samples" in table and ".jsonl:" in table


def test_losses_replay_the_step(run):
    done = hp_train_here("blame", str(run), "--step", "3", "--json", "--losses")
    assert done.returncode == 0, done.stderr
    samples = json.loads(done.stdout)["samples"]
    logged = {r["step"]: r["loss"] for r in records(run)}[3]
    assert all(math.isfinite(s["loss"]) for s in samples) and len(samples) == 4
    assert min(s["loss"] for s in samples) <= logged <= max(s["loss"] for s in samples)


def test_a_megatron_made_corpus_gives_document_ids_only(tmp_path):
    from hp_data import IndexedDatasetBuilder

    prefix = tmp_path / "plain"
    rng = np.random.default_rng(0)
    with IndexedDatasetBuilder(str(prefix), np.uint16) as builder:
        for _ in range(200):
            document = np.append(rng.integers(1, 500, rng.integers(5, 60)), 0)
            builder.add_document(document, [len(document)])
    run = tmp_path / "run"
    assert hp_train_here(*FAST, "data.type=megatron", f"data.path={prefix}", "data.split=1,0,0",
                         "data.seq_length=16", "model.vocab_size=512", "train.steps=2",
                         f"train.run_dir={run}").returncode == 0  # fmt: skip
    report = json.loads(hp_train_here("blame", str(run), "--step", "2", "--json").stdout)
    pieces = [p for s in report["samples"] for p in s["pieces"]]
    assert pieces and all(p["source"] is None and p["document"] >= 0 for p in pieces)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--step", "0"], "--step 0: the run trains steps 1 to 4"),
        (["--step", "5"], "--step 5: the run trains steps 1 to 4"),
    ],
)
def test_bad_steps_are_one_line(run, args, message):
    done = hp_train_here("blame", str(run), *args)
    assert done.returncode == 1 and done.stderr.strip() == f"hp-train: error: {message}"


def test_not_a_run_directory(tmp_path):
    done = hp_train_here("blame", str(tmp_path), "--step", "1")
    assert done.returncode == 1 and "no config.toml here" in done.stderr
