"""Small edges a hostile user found (issue 10, item 19): each once raised the wrong error,
named the wrong file, or did something other than asked without a word."""

from __future__ import annotations

import json

import numpy as np
import pytest
from click.testing import CliRunner
from hp_data import IndexedDataset, IndexedDatasetError, PreprocessError
from hp_data.cli import main
from hp_data.gpt import GPTDataset, GPTDatasetConfig

from tests.helpers.corpus import random_corpus, write_with_hp
from tests.helpers.corpus_files import WRITERS, english_records, write_parquet
from tests.helpers.run import cli, run_preprocess


@pytest.fixture
def prefix(tmp_path) -> str:
    path = str(tmp_path / "corpus")
    write_with_hp(path, random_corpus(4, np.uint16, max_documents=40))
    return path


def test_narrow_numpy_indices_and_reads_after_close(prefix):
    dataset = IndexedDataset(prefix, mmap=False)
    last = dataset[len(dataset) - 1]
    # np.int8(-1) + len(...) overflowed int8 inside the bounds check.
    np.testing.assert_array_equal(dataset[np.int8(-1)], last)
    documents = dataset.num_documents
    np.testing.assert_array_equal(
        dataset.get_document(np.int8(-1)), dataset.get_document(documents - 1)
    )
    dataset.close()
    with pytest.raises(IndexedDatasetError, match=r"corpus: read after close\(\); open it again"):
        dataset[0]


def test_an_empty_batch_has_the_items_shapes(prefix, tmp_path):
    config = GPTDatasetConfig(seq_length=8, split="1,0,0", cache_dir=str(tmp_path / "c"))
    dataset = GPTDataset(prefix, "train", None, config)
    batch, full = dataset.get_batch([]), dataset.get_batch([0])
    assert set(batch) == set(full)
    for key, value in batch.items():
        assert value.shape == (0, 8) and value.dtype == full[key].dtype


def _run(args: list[str]):
    result = CliRunner().invoke(main, [str(a) for a in args])
    assert isinstance(result.exception, SystemExit | None), result.exception
    assert "Traceback" not in result.output
    return result


def test_a_data_path_given_as_the_idx_file_is_its_prefix(prefix, tmp_path):
    result = _run(
        ["build-index", "--data-path", prefix + ".idx", "--seq-len", "8"]
        + ["--split", "1,0,0", "--cache-dir", tmp_path / "c"]
    )
    assert result.exit_code == 0, result.output
    missing = _run(
        ["build-index", "--data-path", tmp_path / "none.idx", "--seq-len", "8"]
        + ["--cache-dir", tmp_path / "c"]
    )
    assert missing.exit_code == 1
    assert f"{tmp_path / 'none'}.idx: no such dataset" in missing.output
    assert ".idx.idx" not in missing.output


def test_an_hf_input_format_on_a_file_says_it_wants_a_directory(tmp_path, example_tokenizer):
    source = WRITERS["jsonl"](tmp_path, english_records(1, 5))
    result = _run(
        ["preprocess", source, "--input-format", "hf-saved"]
        + ["--tokenizer", example_tokenizer, "--out", tmp_path / "out"]
    )
    assert result.exit_code == 1
    assert "--input-format hf-saved reads a directory" in result.output


def test_quiet_silences_the_hf_conversion_bars(tmp_path, example_tokenizer):
    folder = tmp_path / "hf"
    folder.mkdir()
    WRITERS["jsonl"](folder, english_records(1, 20))
    result = _run(
        ["preprocess", folder, "--input-format", "hf", "--quiet"]
        + ["--tokenizer", example_tokenizer, "--out", tmp_path / "out"]
    )
    assert result.exit_code == 0, result.output
    assert "Generating" not in result.output and "examples/s" not in result.output


def test_warnings_are_one_line_and_a_twice_named_merge_input_says_so(prefix, tmp_path):
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    args = ["build-index", "--data-path", prefix, "--seq-len", "8", "--split", "1,0,0"]
    result = cli(*args, "--cache-dir", blocked / "cache")  # a process of its own: real stderr
    assert result.returncode == 0, result.stderr
    assert result.stderr.startswith(
        f"Warning: {blocked / 'cache'}: index cache directory is not writable; using "
    )
    assert len(result.stderr.splitlines()) == 1  # no file, line or source of hp's code
    merged = cli("merge", tmp_path / "m", prefix, prefix, "--quiet")
    assert merged.returncode == 0
    assert merged.stderr == f"Warning: {prefix}: named more than once; merged once\n"
    assert IndexedDataset(tmp_path / "m").num_documents == IndexedDataset(prefix).num_documents


@pytest.mark.parametrize(("suffix", "kind"), [(".jsonl.gz", "gzip"), (".jsonl.zst", "zstd")])
def test_a_zero_byte_compressed_file_is_no_stream_but_an_empty_stream_is_fine(
    tmp_path, example_tokenizer, suffix, kind
):
    import gzip

    import zstandard

    empty = tmp_path / f"cut{suffix}"
    empty.write_bytes(b"")
    tokenizer = ["--tokenizer", example_tokenizer, "--workers", "1", "--quiet"]
    for options in ([], ["--skip-invalid"]):  # a cut file is never read short
        result = _run(["preprocess", empty, "--out", tmp_path / "out", *tokenizer, *options])
        assert result.exit_code == 1
        assert result.stderr == f"Error: {empty}: empty file, not a {kind} stream\n"
        assert sorted(p.name for p in tmp_path.iterdir()) == [empty.name]
    if kind == "gzip":  # nor are no bytes on standard input
        piped = CliRunner().invoke(
            main,
            ["preprocess", "-", "--input-format", "jsonl.gz", "--out", str(tmp_path / "out")]
            + [str(a) for a in tokenizer],
            input=b"",
        )
        assert piped.exit_code == 1
        assert piped.stderr == "Error: standard input: empty, not a gzip stream\n"
    # The empty stream each tool writes for no bytes is a corpus of no documents.
    valid = tmp_path / f"none{suffix}"
    compress = gzip.compress if kind == "gzip" else zstandard.ZstdCompressor().compress
    valid.write_bytes(compress(b""))
    result = _run(["preprocess", valid, "--out", tmp_path / "out", *tokenizer, "--json"])
    assert result.exit_code == 0, result.output
    assert IndexedDataset(tmp_path / "out").num_documents == 0


def test_a_text_past_max_document_chars_is_an_invalid_record_and_shorter_ones_are_untouched(
    tmp_path, example_tokenizer
):
    """One enormous line once took 4.7 GB inside tokenizers: past the limit (here tiny) it is
    refused at file:line before any tokenizing; at or under it nothing changes."""
    from tokenizers import Tokenizer

    texts = ["short one", "exactly twenty chars", "this text is longer than twenty", "end"]
    corpus = tmp_path / "c.jsonl"
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    tokenizer = ["--tokenizer", example_tokenizer, "--workers", "1", "--quiet"]
    refused = _run(
        ["preprocess", corpus, "--out", tmp_path / "x", *tokenizer, "--max-document-chars", "20"]
    )
    assert refused.exit_code == 1
    assert refused.stderr == (
        f"Error: {corpus}:3: 'text' is 31 characters long, more than --max-document-chars 20 "
        "(tokenizing a text takes hundreds of bytes of memory a character); raise the limit, "
        "or skip such records with --skip-invalid\n"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.jsonl"]
    skipped = _run(
        ["preprocess", corpus, "--out", tmp_path / "x", *tokenizer]
        + ["--max-document-chars", "20", "--skip-invalid", "--json"]
    )
    assert skipped.exit_code == 0, skipped.output
    assert json.loads(skipped.stdout)["skipped"]["invalid"] == {"too long": 1}
    reference = Tokenizer.from_file(str(example_tokenizer))
    kept = [t for t in texts if len(t) <= 20]
    dataset = IndexedDataset(tmp_path / "x")
    assert [dataset.get_document(d).tolist() for d in range(dataset.num_documents)] == [
        reference.encode(t, add_special_tokens=False).ids for t in kept
    ]
    table = write_parquet(tmp_path / "t.parquet", [{"text": t} for t in texts])
    with pytest.raises(PreprocessError, match=r"t.parquet: row 3: 'text' is 31 characters long"):
        run_preprocess([table], tmp_path / "p", example_tokenizer, max_document_chars=20)
    for limit in ("31", "0"):  # at the longest text's length, and no limit
        whole = _run(
            [
                "preprocess",
                corpus,
                "--out",
                tmp_path / f"w{limit}",
                *tokenizer,
                "--max-document-chars",
                limit,
            ]
        )
        assert whole.exit_code == 0, whole.output
        dataset = IndexedDataset(tmp_path / f"w{limit}")
        assert [dataset.get_document(d).tolist() for d in range(len(texts))] == [
            reference.encode(t, add_special_tokens=False).ids for t in texts
        ]
