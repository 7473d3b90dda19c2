"""The `hp-data` commands, through click's runner and as a real subprocess."""

from __future__ import annotations

import json
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import xxhash
from click.testing import CliRunner
from hp_data import IndexedDataset
from hp_data.cli import main
from tokenizers import Tokenizer

from tests.helpers.corpus import Corpus, random_corpus, write_with_hp
from tests.helpers.corpus_files import write_jsonl
from tests.helpers.run import cli

HP_DATA = str(Path(sys.executable).parent / "hp-data")


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([HP_DATA, *args], capture_output=True, text=True, timeout=120)


def invoke(*args: str):
    return CliRunner().invoke(main, list(args))


@pytest.fixture(scope="module")
def example_dataset(tmp_path_factory, example_corpus, example_tokenizer) -> str:
    out = str(tmp_path_factory.mktemp("example") / "docstrings")
    result = run(
        "preprocess",
        str(example_corpus),
        "--out",
        out,
        "--tokenizer",
        str(example_tokenizer),
        "--append-eod",
    )
    assert result.returncode == 0, result.stderr
    assert "wrote" in result.stdout and "tokens/s" in result.stdout
    return out


def test_the_main_job_preprocess_then_inspect(example_dataset):
    result = run("inspect", example_dataset + ".idx")
    assert result.returncode == 0, result.stderr
    ds = IndexedDataset(example_dataset)
    for line in (
        "dtype      uint16",
        f"documents  {ds.num_documents:,}",
        f"tokens     {ds.num_tokens:,}",
        "histogram of document lengths:",
    ):
        assert line in result.stdout


def test_inspect_json_agrees_with_the_dataset(example_dataset):
    result = invoke("inspect", example_dataset, "--json", "--check")
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    ds = IndexedDataset(example_dataset)
    lengths = np.diff(ds.sequence_pointers.tolist() + [ds.num_tokens * 2]) // 2  # one seq/doc
    assert report["ok"] is True
    assert report["tokens"] == ds.num_tokens == int(lengths.sum())
    assert report["bin_bytes"] == Path(example_dataset + ".bin").stat().st_size
    stats = report["document_length"]
    assert (stats["min"], stats["max"]) == (int(lengths.min()), int(lengths.max()))
    assert stats["mean"] == pytest.approx(lengths.mean(), abs=0.01)
    assert stats["p50"] == int(np.sort(lengths)[round(0.5 * (len(lengths) - 1))])
    assert sum(row["count"] for row in report["histogram"]) == ds.num_documents
    for row in report["histogram"]:
        assert row["count"] == int(((lengths >= row["low"]) & (lengths <= row["high"])).sum())


def test_inspect_show_decodes_with_the_tokenizer_the_dataset_records(
    example_dataset, example_tokenizer, example_corpus, tmp_path
):
    # From another directory and without --tokenizer: PREFIX.hp.json says which one.
    result = cli("inspect", example_dataset, "--show", "2", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    first = json.loads(example_corpus.open().readline())["text"]
    assert f"--- document 0 ---\n{first}\n--- document 1 ---" in result.stdout
    assert f"tokenizer  {example_tokenizer} (xxh3 " in result.stdout
    recorded = json.loads(invoke("inspect", example_dataset, "--json").output)["tokenizer"]
    assert recorded == {
        "source": str(example_tokenizer),
        "path": str(example_tokenizer.resolve()),
        "xxh3_128": xxhash.xxh3_128_hexdigest(example_tokenizer.read_bytes()),
    }


def _one_line_error(result) -> str:
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit), result.output
    assert result.output.startswith("Error: ") and result.output.count("\n") == 1
    return result.output


def test_inspect_show_refuses_a_recorded_tokenizer_that_changed_or_went(
    tmp_path, example_tokenizer
):
    tokenizer = tmp_path / "tokenizer.json"
    tokenizer.write_bytes(example_tokenizer.read_bytes())
    corpus = write_jsonl(tmp_path / "c.jsonl", [{"text": "hello world"}])
    out = str(tmp_path / "ds")
    made = invoke("preprocess", str(corpus), "--out", out, "--tokenizer", str(tokenizer),
                  "--workers", "1", "--quiet")  # fmt: skip
    assert made.exit_code == 0, made.output
    tokenizer.write_text(json.dumps(json.loads(tokenizer.read_text()), indent=2))
    changed = _one_line_error(invoke("inspect", out, "--show", "1"))
    assert f"Error: {out}.hp.json: its tokenizer {str(tokenizer)!r} is not here as it was (" in (
        changed
    )
    assert f"{tokenizer} has changed since (xxh3 " in changed
    assert changed.endswith("; pass --tokenizer\n")
    told = invoke("inspect", out, "--show", "1", "--tokenizer", str(example_tokenizer))
    assert told.exit_code == 0 and "--- document 0 ---\nhello world\n" in told.output
    tokenizer.unlink()
    gone = _one_line_error(invoke("inspect", out, "--show", "1"))
    assert f"{tokenizer}: no such tokenizer file" in gone and "pass --tokenizer" in gone


def test_inspect_show_without_a_record_asks_for_the_tokenizer(tmp_path):
    prefix = write_with_hp(str(tmp_path / "ds"), random_corpus(0, np.uint16))  # as Megatron's
    refused = _one_line_error(invoke("inspect", prefix, "--show", "1"))
    assert refused == (
        f"Error: {prefix}: no tokenizer recorded beside it (hp-data preprocess writes "
        "ds.hp.json); pass --tokenizer\n"
    )


@pytest.mark.parametrize("dtype", [np.int64, np.float64])
def test_inspect_show_marks_ids_it_cannot_decode(tmp_path, example_tokenizer, dtype):
    # Valid datasets whose ids are negative, beyond 2**32 or the vocabulary, or not integers:
    # each is shown as <id> in place, the rest decoded, never a crash or a silent drop.
    tokenizer = Tokenizer.from_file(str(example_tokenizer))
    hello = tokenizer.encode("hello world").ids
    odd = [-5, 2**40, tokenizer.get_vocab_size() + 3] + ([1.5] if dtype == np.float64 else [])
    ids = np.array([*hello, *odd, *hello], dtype=dtype)
    prefix = write_with_hp(str(tmp_path / "ds"), Corpus(np.dtype(dtype), [[ids]], [[0]]))
    result = invoke("inspect", prefix, "--show", "1", "--tokenizer", str(example_tokenizer))
    assert result.exit_code == 0, result.output
    marks = "".join(f"<{dtype(v).item()}>" for v in odd)
    text = tokenizer.decode(hello)
    assert f"--- document 0 ---\n{text}{marks}{text}\n" in result.output


def test_inspect_check_lists_problems_and_exits_1(tmp_path):
    prefix = write_with_hp(str(tmp_path / "ds"), random_corpus(3, np.uint16))
    raw = bytearray(Path(prefix + ".idx").read_bytes())
    count = struct.unpack_from("<Q", raw, 18)[0]
    struct.pack_into("<q", raw, 34 + 4 * count + 8, 12345)  # second pointer
    Path(prefix + ".idx").write_bytes(bytes(raw))
    Path(prefix + ".bin").write_bytes(Path(prefix + ".bin").read_bytes()[:-2])
    result = run("inspect", prefix, "--check")
    assert result.returncode == 1
    assert result.stderr.startswith("2 problem(s):")
    assert "sequence pointer(s) are not the running sum" in result.stderr
    assert ".bin: size" in result.stderr
    as_json = invoke("inspect", prefix, "--check", "--json")
    assert as_json.exit_code == 1
    assert len(json.loads(as_json.output)["problems"]) == 2


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["inspect", "/nonexistent/ds"], "Error: /nonexistent/ds.idx: no such file"),
        (["merge", "out", "/nonexistent/*.idx"], "pattern matches no files"),
        (
            [
                "preprocess",
                "/nonexistent.jsonl",
                "--out",
                "o",
                "--tokenizer",
                "examples/tokenizer.json",
            ],
            "Error: /nonexistent.jsonl: no such file",
        ),
    ],
)
def test_errors_are_one_line_without_traceback(args, message, repo):
    result = subprocess.run([HP_DATA, *args], capture_output=True, text=True, cwd=repo, timeout=60)
    assert result.returncode != 0
    assert message in result.stderr
    assert "Traceback" not in result.stderr
    if message.startswith("Error:"):
        assert result.stderr.strip().count("\n") == 0


def test_preprocess_bad_line_exit_code_and_no_output(tmp_path, example_tokenizer):
    corpus = tmp_path / "c.jsonl"
    corpus.write_text('{"text": "a"}\n{"text": 1}\n')
    result = run(
        "preprocess",
        str(corpus),
        "--out",
        str(tmp_path / "out"),
        "--tokenizer",
        str(example_tokenizer),
    )
    assert result.returncode == 1
    assert result.stderr.strip() == f"Error: {corpus}:2: 'text' must be a string, got int"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.jsonl"]


def test_preprocess_json_summary(tmp_path, example_tokenizer):
    corpus = tmp_path / "c.jsonl"
    corpus.write_text('{"text": "a b c"}\n{"text": ""}\n')
    result = invoke(
        "preprocess",
        str(corpus),
        "--out",
        str(tmp_path / "out"),
        "--tokenizer",
        str(example_tokenizer),
        "--json",
        "--quiet",
    )
    assert result.exit_code == 0, result.output
    summary = json.loads(result.output)
    assert (summary["documents_in"], summary["documents_written"], summary["skipped"]["empty"]) == (
        2,
        1,
        1,
    )
    assert summary["tokens"] == IndexedDataset(tmp_path / "out").num_tokens


def test_merge_command(tmp_path):
    shards = tmp_path / "shards"
    for i in range(3):
        write_with_hp(str(shards / f"s{i}"), random_corpus(i, np.uint16))
    result = invoke("merge", str(tmp_path / "all"), str(shards))
    assert result.exit_code == 0, result.output
    merged = IndexedDataset(tmp_path / "all")
    parts = [IndexedDataset(shards / f"s{i}") for i in range(3)]
    assert merged.num_documents == sum(p.num_documents for p in parts)
    assert f"merged 3 dataset(s) into {tmp_path / 'all'}" in result.output

    write_with_hp(str(shards / "s9"), random_corpus(9, np.int32))
    refused = invoke("merge", str(tmp_path / "mixed"), str(shards))
    assert refused.exit_code == 1
    assert "cannot merge datasets of different dtypes" in refused.output
    assert not (tmp_path / "mixed.idx").exists()


@pytest.mark.parametrize("command", [[], ["inspect"], ["merge"], ["preprocess"]])
def test_help(command):
    result = invoke(*command, "--help")
    assert result.exit_code == 0
    assert "Usage: " in result.output
