"""Arguments a hostile (or hurried) user types: each is refused with one line that names the
option, exit 1 or 2, and no traceback; nothing is written. Each case below once ended in a
traceback, or was silently read as something else (issue 10, items 6-10, 13, 14)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner
from hp_data import HpDataError
from hp_data.blend import build_datasets
from hp_data.cli import main
from hp_data.gpt import GPTDatasetConfig
from hp_data.index import parse_split
from hp_data.registry import DatasetConfig, build_dataset

from tests.helpers.corpus import random_corpus, write_with_hp

HP_DATA = str(Path(sys.executable).parent / "hp-data")


def _refused(args: list[str], expected: str) -> str:
    result = CliRunner().invoke(main, args)
    # Anything but SystemExit is an exception that escaped the CLI's error boundary.
    assert isinstance(result.exception, SystemExit), result.exception
    assert result.exit_code in (1, 2), result.output
    assert "Traceback" not in result.output
    assert expected in result.output, result.output
    return result.output


INDEX = ["build-index", "--data-path", "/nonexistent/a", "--cache-dir", "/nonexistent/cache"]


@pytest.mark.parametrize(
    "extra, expected",
    [
        (["--seq-len", "8", "--seed", "-1"], "--seed"),
        (["--seq-len", "8", "--seed", str(2**32)], "--seed"),
        (["--seq-len", "99999999999999999999"], "--seq-len"),
        (["--seq-len", "8", "--num-samples=-5"], "--num-samples '-5'"),
        (["--seq-len", "8", "--num-samples", "1,2,3,4"], "--num-samples '1,2,3,4'"),
        (["--seq-len", "8", "--num-samples", "1,,2"], "--num-samples '1,,2'"),
        (["--seq-len", "8", "--split=-1,2,3"], "split '-1,2,3'"),
        (["--seq-len", "8", "--split", "."], "split '.'"),
        (["--seq-len", "8", "--split", "1..2"], "split '1..2'"),
        (["--seq-len", "8", "--split", "nan,1,1"], "split 'nan,1,1'"),
    ],
)
def test_build_index_refuses_bad_numbers(extra, expected):
    _refused([*INDEX, *extra], expected)


@pytest.mark.parametrize(
    "extra",
    [
        ["--global-batch-size", "8"],
        ["--eval-iters", "5"],
        ["--eval-interval", "0"],
        ["--num-samples", "100", "--global-batch-size", "8"],
    ],
)
def test_megatron_size_flags_without_train_iters_are_refused_not_ignored(tmp_path, extra):
    prefix = str(tmp_path / "c")
    write_with_hp(prefix, random_corpus(1, max_documents=10))
    result = CliRunner().invoke(
        main,
        ["build-index", "--data-path", prefix, "--seq-len", "8", "--split", "1,0,0"]
        + ["--cache-dir", str(tmp_path / "cache"), *extra],
    )
    assert result.exit_code == 2
    flag = next(arg for arg in extra if arg != "--num-samples" and arg.startswith("--"))
    assert result.stderr.splitlines()[-1] == (
        f"Error: {flag} sizes the splits only with --train-iters or --train-samples; give one "
        "of them, or leave it out"
    )
    assert not (tmp_path / "cache").exists()


def test_sample_counts_beyond_memory_are_refused_before_any_work(tmp_path):
    prefix = str(tmp_path / "c")
    write_with_hp(prefix, random_corpus(1, max_documents=10))
    _refused(
        ["build-index", "--data-path", prefix, "--seq-len", "8", "--split", "1,0,0"]
        + ["--num-samples", "10000000000", "--cache-dir", str(tmp_path / "cache")],
        "GiB of index arrays, more than this machine's",
    )
    assert not list((tmp_path / "cache").glob("*.npy"))


def test_overflowing_blend_weights_are_refused():
    args = ["build-index", "--data-path", "1e308 /x/a 1e308 /x/b", "--seq-len", "8"]
    _refused([*args, "--cache-dir", "/nonexistent"], "weights' sum overflows")


@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
def test_chunk_size_must_be_a_finite_number(value, example_corpus, example_tokenizer, tmp_path):
    out = tmp_path / "x"
    args = ["preprocess", str(example_corpus), "--tokenizer", str(example_tokenizer)]
    _refused([*args, "--out", str(out), f"--chunk-mb={value}"], "--chunk-mb")
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("out", ["", "sub/", "sub/.bin"])
def test_an_output_prefix_needs_a_file_name(out, example_corpus, example_tokenizer, tmp_path):
    (tmp_path / "sub").mkdir()
    result = subprocess.run(
        [HP_DATA, "preprocess", str(example_corpus), "--tokenizer", str(example_tokenizer)]
        + ["--out", out, "--quiet"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert result.returncode == 1, result.stderr
    assert result.stderr.startswith(f"Error: --out {out!r}: the prefix needs a file name")
    assert len(result.stderr.strip().splitlines()) == 1
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["sub"]


def test_the_library_refuses_the_same_values_by_name(tmp_path):
    with pytest.raises(HpDataError, match="seed -1: give a seed from 0 to 2"):
        GPTDatasetConfig(seq_length=8, seed=-1)
    with pytest.raises(HpDataError, match="seq_length 0"):
        GPTDatasetConfig(seq_length=0)
    with pytest.raises(HpDataError, match="seed 4294967296"):
        build_dataset(DatasetConfig(type="megatron", seq_length=8, path="/x/a", seed=2**32))
    with pytest.raises(HpDataError, match="seed -1"):
        build_dataset(DatasetConfig(type="dummy", seq_length=8, seed=-1))
    config = GPTDatasetConfig(seq_length=8, cache_dir=str(tmp_path))
    with pytest.raises(HpDataError, match="4 sample counts given"):
        build_datasets("/x/a", config, [1, 2, 3, 4])
    with pytest.raises(HpDataError, match="valid sample count -1 is negative"):
        build_datasets("/x/a", config, [1, -1])
    with pytest.raises(HpDataError, match="blend_per_split has 2 entries"):
        build_datasets(None, config, blend_per_split=["/x/a", None])


def test_split_shares_parse_as_megatron_writes_them():
    assert parse_split("969,30,1") == pytest.approx([0.969, 0.030, 0.001])
    assert parse_split("98/2/0") == pytest.approx([0.98, 0.02, 0.0])
    assert parse_split(" 1, 1 ") == pytest.approx([0.5, 0.5, 0.0])
    assert parse_split("0.8 0.1 .1") == pytest.approx([0.8, 0.1, 0.1])
    assert parse_split([1, 0, 1]) == pytest.approx([0.5, 0.0, 0.5])
    for bad in ["", "0,0,0", "1,2,3,4", "1;2", "inf,1"]:
        with pytest.raises(HpDataError, match="give up to three non-negative shares"):
            parse_split(bad)


@pytest.mark.parametrize(
    "flag, value",
    [
        (flag, value)
        for flag in ("--max-document-chars", "--ray-schedule-timeout", "--remote-timeout")
        for value in ("-1", "nan", "inf", "1e999", "ten", "")
    ]
    + [("--max-document-chars", "1.5"), ("--max-document-chars", "9" * 30)],
)
def test_preprocess_refuses_bad_values_of_its_new_flags(tmp_path, flag, value):
    """Issue 29's flags, with generated bad values: one line naming the flag, nothing written.
    (`--max-document-chars 0` means no limit; a huge integer is a limit no text reaches.)"""
    corpus = tmp_path / "c.jsonl"
    corpus.write_text('{"text": "a"}\n')
    ray = ["--ray"] if flag == "--ray-schedule-timeout" else []
    args = ["preprocess", str(corpus), "--out", str(tmp_path / "o"), "--tokenizer", "none", *ray]
    if value == "9" * 30:  # accepted by click: refused, if at all, for the missing tokenizer
        result = CliRunner().invoke(main, [*args, flag, value])
        assert isinstance(result.exception, SystemExit) and "Traceback" not in result.output
    else:
        _refused([*args, flag, value], flag)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.jsonl"]
