"""Every registered dataset type gives the same item contract; build-index reports its work."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hp_data import HpDataError
from hp_data.gpt import GPTDataset, GPTDatasetConfig
from hp_data.registry import DATASET_REGISTRY, DatasetConfig, build_dataset

from tests.helpers.corpus_files import WRITERS, english_records
from tests.helpers.run import run_preprocess

HP_DATA = str(Path(sys.executable).parent / "hp-data")


def _check_contract(dataset, seq_length: int) -> None:
    assert len(dataset) > 0
    for i in (0, len(dataset) - 1):
        item = dataset[i]
        assert item["tokens"].shape == item["labels"].shape == (seq_length,)
        assert item["tokens"].dtype == item["labels"].dtype == np.int64
        assert item["loss_mask"].dtype == np.float32 and item["loss_mask"].shape == (seq_length,)
        np.testing.assert_array_equal(item["position_ids"][:1], [0])


@pytest.fixture(scope="module")
def prefix(tmp_path_factory, example_corpus, example_tokenizer) -> str:
    out = tmp_path_factory.mktemp("registry") / "docs"
    run_preprocess([example_corpus], out, example_tokenizer, append_eod=True)
    return str(out)


def test_dummy_is_deterministic(tmp_path):
    config = DatasetConfig(type="dummy", seq_length=32, vocab_size=100, seed=3)
    a, b = build_dataset(config, num_samples=50), build_dataset(config, num_samples=50)
    _check_contract(a, 32)
    np.testing.assert_array_equal(a[7]["tokens"], b[7]["tokens"])
    np.testing.assert_array_equal(a[7]["labels"][:-1], a[7]["tokens"][1:])
    assert a[7]["tokens"].max() < 100
    assert not np.array_equal(a[7]["tokens"], a[8]["tokens"])


def test_megatron_type_is_a_gpt_dataset_or_a_blend(tmp_path, prefix):
    config = DatasetConfig(type="megatron", seq_length=64, path=prefix, cache_dir=str(tmp_path))
    dataset = build_dataset(config, "valid")
    _check_contract(dataset, 64)
    direct = GPTDataset(
        prefix, "valid", None, GPTDatasetConfig(seq_length=64, cache_dir=str(tmp_path))
    )
    np.testing.assert_array_equal(dataset[3]["tokens"], direct[3]["tokens"])
    blend = build_dataset(
        DatasetConfig(
            type="megatron",
            seq_length=64,
            path=f"0.5 {prefix} 0.5 {prefix}",
            cache_dir=str(tmp_path),
        ),
        num_samples=300,
    )
    assert len(blend) == 300
    assert set(np.unique(blend.dataset_index).tolist()) == {0, 1}
    _check_contract(blend, 64)


@pytest.mark.parametrize(("kind", "fmt"), [("json_file", "jsonl"), ("hf_datasets", "hf-saved")])
def test_tokenizing_types_pack_the_corpus(tmp_path, example_tokenizer, kind, fmt):
    records = english_records(4, 200)
    source = WRITERS[fmt](tmp_path, records)
    config = DatasetConfig(
        type=kind,
        seq_length=48,
        path=str(source),
        tokenizer=str(example_tokenizer),
        cache_dir=str(tmp_path / "c"),
        return_cu_seqlens=True,
    )
    dataset = build_dataset(config)
    _check_contract(dataset, 48)
    # The same as preprocessing by hand and building a one-split GPTDataset.
    run_preprocess([source], tmp_path / "manual", example_tokenizer, append_eod=True)
    manual = GPTDataset(
        str(tmp_path / "manual"),
        "train",
        None,
        GPTDatasetConfig(seq_length=48, split="1,0,0", cache_dir=str(tmp_path / "m")),
    )
    assert len(dataset) == len(manual)
    for i in range(0, len(manual), 11):
        np.testing.assert_array_equal(dataset[i]["tokens"], manual[i]["tokens"])
        cu = dataset[i]["cu_seqlens"]
        assert cu[0] == 0 and cu[-1] == 48 and np.all(np.diff(cu) > 0)
    again = build_dataset(config)  # tokenized once: the cache is reused
    assert again.dataset.path_prefix == dataset.dataset.path_prefix


def test_unknown_type_and_missing_path_are_clear():
    with pytest.raises(
        HpDataError,
        match="unknown dataset type 'nope'; choose one of " + ", ".join(DATASET_REGISTRY),
    ):
        build_dataset(DatasetConfig(type="nope", seq_length=8))
    with pytest.raises(HpDataError, match="'megatron' needs a path"):
        build_dataset(DatasetConfig(type="megatron", seq_length=8))
    with pytest.raises(HpDataError, match="needs a tokenizer"):
        build_dataset(DatasetConfig(type="json_file", seq_length=8, path="x.jsonl"))
    with pytest.raises(HpDataError, match="no such dataset"):
        build_dataset(DatasetConfig(type="megatron", seq_length=8, path="/nonexistent/p"))


@pytest.mark.parametrize("kind", ["dummy", "megatron"])
@pytest.mark.parametrize("name", ["train", "valid", "test"])
def test_a_split_name_given_as_the_shares_names_build_datasets_argument(kind, name):
    """`split` is the shares now; a split's name there (what it held before) says where the
    name goes, and that call builds."""
    with pytest.raises(HpDataError, match=rf"build_dataset\(config, '{name}'\)"):
        DatasetConfig(type=kind, seq_length=8, path="/nonexistent/p", split=name)
    dataset = build_dataset(DatasetConfig(type="dummy", seq_length=8), name, 3)
    assert len(dataset) == 3


UNGUARDED_SCRIPT = """
from hp_data.registry import DatasetConfig, build_dataset

config = DatasetConfig(
    type="json_file", seq_length=16, path={path!r}, tokenizer={tokenizer!r},
    cache_dir={cache!r}, workers={workers},
)
print("samples", len(build_dataset(config)))
"""


@pytest.mark.parametrize("workers", [2, 1])
def test_a_script_without_a_main_guard_fails_or_works_but_never_hangs(
    tmp_path, example_tokenizer, workers
):
    # Spawned tokenizer workers re-run the script; they used to block forever on the lock
    # the parent holds. Two workers now fail with what to do; one tokenizes in-process.
    source = WRITERS["jsonl"](tmp_path, english_records(5, 50))
    script = tmp_path / "script.py"
    script.write_text(
        UNGUARDED_SCRIPT.format(
            path=str(source),
            tokenizer=str(example_tokenizer),
            cache=str(tmp_path / "c"),
            workers=workers,
        )
    )
    result = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=120, cwd=tmp_path
    )
    if workers == 1:
        assert result.returncode == 0 and result.stdout.startswith("samples "), result.stderr
    else:
        assert result.returncode == 1
        assert "if __name__ == '__main__':" in result.stderr.strip().splitlines()[-1]


def test_build_index_cli_builds_then_hits_the_cache(tmp_path, prefix):
    command = [
        HP_DATA,
        "build-index",
        "--data-path",
        prefix,
        "--seq-len",
        "64",
        "--seed",
        "5",
        "--num-samples",
        "3000,50",
        "--cache-dir",
        str(tmp_path),
        "--json",
    ]
    first = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert first.returncode == 0, first.stderr
    report = json.loads(first.stdout)["splits"]
    assert set(report) == {"train", "valid", "test"}
    assert report["train"]["samples"] >= 3000 and report["valid"]["samples"] >= 50
    assert not report["train"]["cache_hit"]
    for entry in report.values():
        assert all(Path(f).exists() for f in entry["files"])
        assert any(
            f.endswith("-GPTDataset-train-shuffle_index.npy") for f in report["train"]["files"]
        )
    second = json.loads(subprocess.run(command, capture_output=True, text=True).stdout)["splits"]
    assert all(entry["cache_hit"] and entry["build_seconds"] == 0 for entry in second.values())
    # Without --num-samples, each split gets one epoch; the indices equal GPTDataset's.
    one_epoch = json.loads(
        subprocess.run(command[:8] + command[10:], capture_output=True, text=True).stdout
    )["splits"]
    direct = GPTDataset(
        prefix, "train", None, GPTDatasetConfig(seq_length=64, seed=5, cache_dir=str(tmp_path))
    )
    assert one_epoch["train"]["samples"] == len(direct)
    bad = subprocess.run(
        [
            HP_DATA,
            "build-index",
            "--data-path",
            "0.3 /nonexistent/a 0.7",
            "--seq-len",
            "8",
            "--cache-dir",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
    )
    assert bad.returncode == 1 and "weight/prefix pairs" in bad.stderr
    assert "Traceback" not in bad.stderr
