"""How a run's batches and sample counts are planned (Megatron's arithmetic)."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest
from hp_data import IndexedDataset, IndexedDatasetBuilder, merge_datasets
from hp_data.format.metadata import read_metadata
from hp_data.gpt import GPTDataset, GPTDatasetConfig
from hp_runtime.train.batch import batch_plan
from hp_runtime.train.config import ConfigError, load_config
from hp_runtime.train.data import build_datasets, resolve_data, sample_counts
from hp_runtime.train.launch import TrainError

from tests.helpers.run import run_preprocess
from tests.helpers.train import FAST, hp_train


def _config(*overrides: str):
    return load_config(None, ["data.type=dummy", "data.seq_length=16", *overrides])


def test_megatron_sample_counts():
    config = _config(
        "train.steps=100",
        "train.micro_batch_size=2",
        "train.global_batch_size=8",
        "parallel.dp_shard=2",
        "train.eval_interval=10",
        "train.eval_iters=5",
    )
    plan = batch_plan(config)
    assert (plan.global_batch_size, plan.dp_size, plan.accumulation) == (8, 2, 2)
    # Megatron: train_iters * gbs; eval_iters * gbs * (train_iters // eval_interval + 1)
    assert sample_counts(config, plan) == (800, 5 * 8 * 11)
    assert sample_counts(_config("train.steps=7"), batch_plan(_config("train.steps=7"))) == (7, 0)


def test_default_global_batch_is_one_micro_batch_per_rank():
    plan = batch_plan(_config("train.steps=1", "train.micro_batch_size=3", "parallel.dp_shard=4"))
    assert (plan.global_batch_size, plan.accumulation) == (12, 1)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["train.global_batch_size=10", "train.micro_batch_size=4"],
            "train.global_batch_size=10 is not a multiple of train.micro_batch_size x "
            "data-parallel size = 4 x 1 = 4",
        ),
        (
            ["train.global_batch_size=12", "parallel.pp=2", "parallel.pp_microbatches=5"],
            "parallel.pp_microbatches=5 does not divide the 12 micro-batches per step",
        ),
    ],
)
def test_batches_that_do_not_fit(overrides, message):
    with pytest.raises(ConfigError, match=message.replace(".", r"\.")):
        batch_plan(_config("train.steps=1", *overrides))


# -- the data's token ids against the model, checked before the first step ------------------

VOCAB = 300  # the model.vocab_size of the checks below


@pytest.fixture(scope="module")
def runtime():
    """One in-process rank (gloo on an in-memory store), as `hp-train` runs without torchrun."""
    from hp_runtime.train.launch import start, stop

    yield start("cpu", 1)
    stop()


def _write(prefix, documents, dtype=np.uint16, metadata=None) -> str:
    with IndexedDatasetBuilder(prefix, dtype, metadata=metadata) as builder:
        for document in documents:
            builder.add_document(document, [len(document)])
    return str(prefix)


def _documents(seed: int, high: int, count: int = 40) -> list[np.ndarray]:
    """Documents of ids below `high`, each ending with EOD id 0; the last holds `high - 1`."""
    rng = np.random.default_rng(seed)
    docs = [np.append(rng.integers(1, high - 1, rng.integers(3, 20)), 0) for _ in range(count)]
    docs[-1][0] = high - 1
    return docs


def _megatron(path: str, tmp_path, *overrides: str):
    return _config(
        "data.type=megatron",
        f"data.path={path}",
        "data.seq_length=8",
        "data.split=1,0,0",
        f"data.cache_dir={tmp_path / 'cache'}",
        "train.steps=2",
        "model.preset=tiny",
        f"model.vocab_size={VOCAB}",
        *overrides,
    )


def _build(config, runtime, tmp_path):
    config = replace(config, train=replace(config.train, run_dir=str(tmp_path / "run")))
    return build_datasets(resolve_data(config, batch_plan(config)), runtime, True)


def _refused(config, runtime, tmp_path) -> str:
    with pytest.raises(TrainError) as info:
        _build(config, runtime, tmp_path)
    message = str(info.value)
    assert "\n" not in message
    return message


def test_a_vocab_size_below_the_largest_id_is_refused(runtime, tmp_path):
    prefix = _write(tmp_path / "a", _documents(1, VOCAB + 1))  # holds id 300
    assert _refused(_megatron(prefix, tmp_path), runtime, tmp_path) == (
        f"model.vocab_size = {VOCAB} but {prefix} holds token id {VOCAB}: "
        f"set model.vocab_size to at least {VOCAB + 1}"
    )
    fits = _build(_megatron(prefix, tmp_path, f"model.vocab_size={VOCAB + 1}"), runtime, tmp_path)
    assert len(fits.train) >= 2  # whole epochs, as Megatron builds them


def test_every_prefix_of_a_blend_is_checked(runtime, tmp_path):
    low = _write(tmp_path / "low", _documents(2, VOCAB))
    high = _write(tmp_path / "high", _documents(3, VOCAB + 7))  # the second holds id 306
    config = _megatron(f"0.5 {low} 0.5 {high}", tmp_path)
    message = _refused(config, runtime, tmp_path)
    assert message.startswith(f"model.vocab_size = {VOCAB} but {high} holds token id 306:")


def test_a_scan_is_recorded_and_a_restart_reads_the_record(runtime, tmp_path):
    prefix = _write(tmp_path / "a", _documents(4, VOCAB))
    config = _megatron(prefix, tmp_path)
    _build(config, runtime, tmp_path)
    (record,) = (tmp_path / "cache").glob("*-token-ids.json")
    assert json.loads(record.read_text())["largest"] == VOCAB - 1
    # the second set-up believes the record (here made to say more) instead of reading the .bin
    record.write_text(json.dumps({"largest": 4000, "smallest": 0}))
    assert "holds token id 4000:" in _refused(config, runtime, tmp_path)
    # a regenerated .bin is another corpus: scanned again
    _write(tmp_path / "a", _documents(5, VOCAB))
    _build(config, runtime, tmp_path)
    assert len(list((tmp_path / "cache").glob("*-token-ids.json"))) == 2


def test_preprocess_records_the_largest_id_and_merge_combines_it(
    runtime, tmp_path, example_corpus, example_tokenizer
):
    out = tmp_path / "docs"
    run_preprocess([example_corpus], out, example_tokenizer, append_eod=True)
    with IndexedDataset(str(out)) as dataset:
        largest = int(np.concatenate(dataset[:]).max())
    metadata = read_metadata(str(out))
    assert metadata["max_token_id"] == largest and metadata["vocab_size"] == 8192
    config = _megatron(str(out), tmp_path, "model.vocab_size=1000")
    assert _refused(config, runtime, tmp_path) == (
        f"model.vocab_size = 1000 but {out} holds token id {largest} (the tokenizer's "
        f"vocabulary is 8192): set model.vocab_size to at least {largest + 1}"
    )
    assert not list((tmp_path / "cache").glob("*-token-ids.json"))  # nothing was scanned
    # merged after a dataset of the same tokenizer holding smaller ids: the largest of both
    other = _write(tmp_path / "other", [np.array([5, 0])], metadata={**metadata, "max_token_id": 5})
    merge_datasets(str(tmp_path / "merged"), [other, str(out)])
    assert read_metadata(str(tmp_path / "merged"))["max_token_id"] == largest


def test_a_tokenizer_larger_than_the_model_is_refused(runtime, tmp_path, example_tokenizer):
    config = _config(
        "data.type=json_file",
        f"data.path={tmp_path / 'none.jsonl'}",
        f"data.tokenizer={example_tokenizer}",
        "train.steps=1",
        "model.vocab_size=8000",
    )
    assert _refused(config, runtime, tmp_path) == (
        f"model.vocab_size = 8000 but the tokenizer {example_tokenizer} holds token id 8191 "
        f"(the tokenizer's vocabulary is 8192): set model.vocab_size to at least 8192"
    )


@pytest.mark.parametrize("eod", [-1, VOCAB])
def test_an_eod_token_outside_the_vocabulary_is_refused(eod):
    with pytest.raises(ConfigError, match=rf"^data\.eod_token.*{eod}"):  # range or vocabulary
        _config(f"data.eod_token={eod}", f"model.vocab_size={VOCAB}", "train.steps=1")


def _masks(datasets) -> list[np.ndarray]:
    return [datasets.train[i]["loss_mask"] for i in range(len(datasets.train))]


def test_the_eod_id_recorded_beside_the_data_masks_as_the_key_does(runtime, tmp_path):
    recorded = {"schema": 1, "eod": 0, "bos": None}
    prefix = _write(tmp_path / "a", _documents(6, VOCAB), metadata=recorded)
    from_record = _build(_megatron(prefix, tmp_path, "data.eod_mask_loss=true"), runtime, tmp_path)
    given = _megatron(prefix, tmp_path, "data.eod_mask_loss=true", "data.eod_token=0")
    from_key = _build(given, runtime, tmp_path)
    items = [from_record.train[i] for i in range(len(from_record.train))]
    for item, mask, same in zip(items, _masks(from_record), _masks(from_key), strict=True):
        np.testing.assert_array_equal(mask, item["tokens"] != 0)  # no loss on EOD inputs
        np.testing.assert_array_equal(mask, same)
    assert (np.concatenate(_masks(from_record)) == 0).any()


def test_eod_ids_that_disagree_or_are_missing_are_refused(runtime, tmp_path):
    recorded = {"schema": 1, "eod": 0, "bos": None}
    a = _write(tmp_path / "a", _documents(7, VOCAB), metadata=recorded)
    b = _write(tmp_path / "b", _documents(8, VOCAB), metadata={**recorded, "eod": 5})
    bare = _write(tmp_path / "bare", _documents(9, VOCAB))
    mask = "data.eod_mask_loss=true"
    assert _refused(_megatron(a, tmp_path, "data.eod_token=5"), runtime, tmp_path) == (
        f"data.eod_token = 5 but {a}.hp.json records EOD id 0: set data.eod_token = 0, "
        f"or leave it unset"
    )
    blend = _refused(_megatron(f"1 {a} 1 {b}", tmp_path, mask), runtime, tmp_path)
    assert blend.startswith("data.eod_mask_loss needs one end-of-document id")
    assert f"{a} 0, {b} 5" in blend and blend.endswith("set data.eod_token")
    assert _refused(_megatron(bare, tmp_path, mask), runtime, tmp_path) == (
        f"data.eod_mask_loss needs the end-of-document id and {bare}.hp.json records none: "
        f"set data.eod_token"
    )


def test_hp_train_refuses_a_small_vocab_in_one_line(tmp_path):
    prefix = _write(tmp_path / "a", _documents(10, VOCAB + 1))
    done = hp_train(
        *FAST,
        "data.type=megatron",
        f"data.path={prefix}",
        "data.seq_length=8",
        "data.split=1,0,0",
        "train.steps=2",
        f"train.run_dir={tmp_path / 'run'}",
        f"model.vocab_size={VOCAB}",
    )
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines() == [
        f"hp-train: error: model.vocab_size = {VOCAB} but {prefix} holds token id {VOCAB}: "
        f"set model.vocab_size to at least {VOCAB + 1}"
    ]


# -- a tokenized file's split: the shares given, else the whole file ---------------------------


@pytest.fixture(scope="module")
def small_corpus(tmp_path_factory, example_corpus, example_tokenizer):
    """300 lines of the example corpus, and hp-data's own preprocess of them (the reference)."""
    root = tmp_path_factory.mktemp("small-corpus")
    corpus = root / "docs.jsonl"
    corpus.write_text("".join(example_corpus.read_text().splitlines(True)[:300]))
    run_preprocess([corpus], root / "reference", example_tokenizer, append_eod=True)
    return corpus, str(root / "reference")


@pytest.mark.parametrize("split", [None, "969,30,1", "80,20,0"])
def test_a_tokenized_file_is_split_by_the_shares_given(
    split, runtime, tmp_path, small_corpus, example_tokenizer
):
    """Against GPTDatasets built directly over those shares (unset: the whole file) from
    hp-data's preprocess. "969,30,1" is Megatron's default and must not read as unset."""
    corpus, prefix = small_corpus
    given = [] if split is None else [f"data.split={split}"]
    config = _config(
        "data.type=json_file",
        f"data.path={corpus}",
        f"data.tokenizer={example_tokenizer}",
        f"data.cache_dir={corpus.parent / 'cache'}",  # tokenized once for all three
        "train.steps=3",
        f"train.eval_interval={0 if split is None else 3}",
        "train.eval_iters=2",
        "model.vocab_size=8192",
        *given,
    )
    built = _build(config, runtime, tmp_path)
    shares = split or "1,0,0"
    for name, dataset in (("train", built.train), ("valid", built.valid)):
        if dataset is None:
            assert split is None and name == "valid"
            continue
        reference = GPTDataset(
            prefix,
            name,
            len(dataset),
            GPTDatasetConfig(seq_length=16, split=shares, cache_dir=str(tmp_path / "ref")),
        )
        assert len(dataset) == len(reference) > 0
        for i in range(len(dataset)):
            np.testing.assert_array_equal(dataset[i]["tokens"], reference[i]["tokens"])
        assert built.identity[name]["split_shares"] == shares


@pytest.mark.parametrize("key", ["document_masking", "reset_position_ids", "eod_mask_loss"])
def test_a_key_that_reads_documents_needs_an_eod_id_the_data_gives(runtime, tmp_path, key):
    """Dummy samples know no end-of-document id: a key that reads documents is refused in one
    line rather than silently reading none; given data.eod_token, the data is built."""
    config = _config(f"data.{key}=true", "train.steps=1")
    assert _refused(config, runtime, tmp_path) == (
        f"data.{key} needs the end-of-document id, which this data does not give: set "
        f"data.eod_token"
    )
    given = _build(
        _config(f"data.{key}=true", "train.steps=1", "data.eod_token=3"), runtime, tmp_path
    )
    assert given.eod_token == 3


_PREFETCH_EXIT = """
import sys, torch
from hp_runtime.train.loader import _Prefetch

def batches():  # collating keeps the thread busy in torch (the GIL released) at exit
    while True:
        yield torch.stack([torch.ones(256, 256) for _ in range(64)])

for _ in range(3):
    prefetch = _Prefetch(batches(), depth=2)
    next(prefetch)
    if sys.argv[1] == "close":
        prefetch.close()
        assert not prefetch._thread.is_alive()
"""


def test_the_prefetch_thread_is_stopped_before_the_process_exits(tmp_path):
    """A receiving thread still collating when the interpreter exits aborts the process
    (pytorch#38228): a finished run exited with SIGABRT now and then under torchrun. The
    script aborts every time without `close`."""
    import subprocess
    import sys

    script = tmp_path / "exit.py"
    script.write_text(_PREFETCH_EXIT)
    done = subprocess.run([sys.executable, script, "close"], capture_output=True, timeout=120)
    assert done.returncode == 0, done.stderr.decode()[-2000:]
