"""preprocess writes exactly the tokenizer's ids, identically for any number of workers."""

from __future__ import annotations

import json
import warnings

import numpy as np
import pytest
from hp_data import IndexedDataset, PreprocessError
from tokenizers import Tokenizer, models, pre_tokenizers

from tests.helpers.corpus_files import english_records, write_jsonl
from tests.helpers.run import cli, read_bytes, run_preprocess


def _expected(tokenizer: Tokenizer, texts, bos=None, eod=None) -> list[list[int]]:
    docs = []
    for text in texts:
        ids = tokenizer.encode(text, add_special_tokens=False).ids
        if ids:
            ids = ([bos] if bos is not None else []) + ids + ([eod] if eod is not None else [])
        docs.append(ids)
    return docs


def test_ids_equal_the_tokenizers_own_plus_eod(tmp_path, example_corpus, example_tokenizer):
    summary = run_preprocess(
        [example_corpus], tmp_path / "out", example_tokenizer, append_eod=True, chunk_bytes=64 << 10
    )
    tokenizer = Tokenizer.from_file(str(example_tokenizer))
    eod = tokenizer.token_to_id("<|endoftext|>")
    texts = [json.loads(line)["text"] for line in example_corpus.open(encoding="utf-8")]
    ds = IndexedDataset(tmp_path / "out")
    assert ds.dtype == np.uint16  # an 8,192-token vocabulary
    assert ds.num_documents == len(texts) == summary.documents_written
    assert summary.tokens == ds.num_tokens
    for d, expected in enumerate(_expected(tokenizer, texts, eod=eod)):
        assert ds.get_document(d).tolist() == expected
    # One sequence per document, as Megatron's preprocess_data.py writes.
    assert ds.document_indices.tolist() == list(range(len(texts) + 1))


@pytest.mark.slow
def test_several_workers_write_the_same_bytes_as_one(tmp_path, example_corpus, example_tokenizer):
    one = run_preprocess(
        [example_corpus], tmp_path / "one", example_tokenizer, append_eod=True, workers=1
    )
    two = run_preprocess(
        [example_corpus],
        tmp_path / "two",
        example_tokenizer,
        append_eod=True,
        workers=2,
        chunk_bytes=32 << 10,
    )
    three = run_preprocess(
        [example_corpus],
        tmp_path / "three",
        example_tokenizer,
        append_eod=True,
        workers=3,
        chunk_bytes=100 << 10,
    )
    assert read_bytes(tmp_path / "one") == read_bytes(tmp_path / "two")
    assert read_bytes(tmp_path / "one") == read_bytes(tmp_path / "three")
    assert one.tokens == two.tokens == three.tokens


def test_megatron_reads_the_output(tmp_path, example_corpus, example_tokenizer):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        indexed = pytest.importorskip("megatron.core.datasets.indexed_dataset")
    run_preprocess([example_corpus], tmp_path / "out", example_tokenizer, append_eod=True)
    theirs = indexed.IndexedDataset(str(tmp_path / "out"))
    ours = IndexedDataset(tmp_path / "out")
    assert len(theirs) == len(ours)
    for i in range(0, len(ours), 97):
        np.testing.assert_array_equal(theirs[i], ours[i])


def test_several_keys_write_one_aligned_output_each(tmp_path, example_tokenizer):
    records = english_records(3, 300, keys=("text", "title"))
    corpus = write_jsonl(tmp_path / "c.jsonl", records)
    summary = run_preprocess(
        [corpus], tmp_path / "out", example_tokenizer, json_keys=("text", "title"), append_eod=True
    )
    assert summary.outputs == {
        "text": str(tmp_path / "out_text_document"),
        "title": str(tmp_path / "out_title_document"),
    }
    tokenizer = Tokenizer.from_file(str(example_tokenizer))
    eod = tokenizer.token_to_id("<|endoftext|>")
    # A record is skipped only when every key is empty; otherwise each key gets a document,
    # an empty text becoming a document with no sequences.
    kept = [r for r in records if r["text"] or r["title"]]
    assert summary.skipped["empty"] == len(records) - len(kept)
    for key in ("text", "title"):
        ds = IndexedDataset(tmp_path / f"out_{key}_document")
        assert ds.num_documents == len(kept)
        for d, expected in enumerate(_expected(tokenizer, [r[key] for r in kept], eod=eod)):
            assert ds.get_document(d).tolist() == expected
            count = ds.document_indices[d + 1] - ds.document_indices[d]
            assert count == (1 if expected else 0)


def test_hf_tokenizer_dir_names_eos_and_bos(tmp_path, example_tokenizer):
    directory = tmp_path / "tok"
    directory.mkdir()
    (directory / "tokenizer.json").write_bytes(example_tokenizer.read_bytes())
    (directory / "tokenizer_config.json").write_text(
        json.dumps({"eos_token": {"content": "the"}, "bos_token": "<|endoftext|>"})
    )
    tokenizer = Tokenizer.from_file(str(example_tokenizer))
    eos, bos = tokenizer.token_to_id("the"), tokenizer.token_to_id("<|endoftext|>")
    corpus = write_jsonl(tmp_path / "c.jsonl", [{"text": "hello world"}, {"text": ""}])
    run_preprocess([corpus], tmp_path / "out", directory, append_eod=True, add_bos=True)
    ds = IndexedDataset(tmp_path / "out")
    assert ds.num_documents == 1
    assert ds[0].tolist() == _expected(tokenizer, ["hello world"], bos=bos, eod=eos)[0]
    run_preprocess([corpus], tmp_path / "o2", directory, append_eod=True, eod_token="<|endoftext|>")
    assert IndexedDataset(tmp_path / "o2")[0].tolist()[-1] == bos


def test_a_configured_eos_token_missing_from_the_vocabulary_is_an_error(
    tmp_path, example_tokenizer
):
    directory = tmp_path / "tok"
    directory.mkdir()
    (directory / "tokenizer.json").write_bytes(example_tokenizer.read_bytes())
    config = directory / "tokenizer_config.json"
    config.write_text(json.dumps({"eos_token": "</s>"}))
    assert Tokenizer.from_file(str(example_tokenizer)).token_to_id("</s>") is None
    corpus = write_jsonl(tmp_path / "c.jsonl", [{"text": "hello world"}])
    args = ["preprocess", str(corpus), "--out", str(tmp_path / "out"), "--append-eod", "--quiet"]
    result = cli(*args, "--tokenizer", str(directory))
    assert result.returncode == 1
    assert result.stderr.strip() == (
        f"Error: {config}: eos_token '</s>' is not in the vocabulary of "
        f"{directory / 'tokenizer.json'}; correct it or name the token with --eod-token"
    )
    assert not list(tmp_path.glob("out*"))
    # Named on the command line, the run goes through.
    ok = cli(*args, "--tokenizer", str(directory), "--eod-token", "<|endoftext|>")
    assert ok.returncode == 0, ok.stderr


def test_keep_empty_writes_documents_without_sequences(tmp_path, example_tokenizer):
    corpus = write_jsonl(tmp_path / "c.jsonl", [{"text": "a b"}, {"text": ""}, {"text": "c"}])
    skipped = run_preprocess([corpus], tmp_path / "skip", example_tokenizer, append_eod=True)
    kept = run_preprocess(
        [corpus], tmp_path / "keep", example_tokenizer, append_eod=True, keep_empty=True
    )
    assert (skipped.documents_written, skipped.skipped["empty"]) == (2, 1)
    assert (kept.documents_written, kept.skipped["empty"]) == (3, 0)
    ds = IndexedDataset(tmp_path / "keep")
    assert ds.document_indices.tolist() == [0, 1, 1, 2]  # Megatron's zero-sequence document
    assert ds.get_document(1).tolist() == []


def test_a_large_vocabulary_gets_int32_and_dtype_can_be_forced(tmp_path):
    vocab = {f"w{i}": i for i in range(70_000)}
    vocab["[UNK]"] = 70_000
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(tmp_path / "tok.json"))
    corpus = write_jsonl(tmp_path / "c.jsonl", [{"text": "w1 w69999 w65536 nope"}])
    summary = run_preprocess([corpus], tmp_path / "out", tmp_path / "tok.json")
    assert summary.dtype == "int32"
    assert IndexedDataset(tmp_path / "out")[0].tolist() == [1, 69999, 65536, 70000]
    forced = run_preprocess([corpus], tmp_path / "wide", tmp_path / "tok.json", dtype="int64")
    assert forced.dtype == "int64"
    with pytest.raises(PreprocessError, match="--dtype uint16 cannot hold ids of a 70001-token"):
        run_preprocess([corpus], tmp_path / "o2", tmp_path / "tok.json", dtype="uint16")


def test_missing_special_tokens_are_named(tmp_path, example_tokenizer):
    corpus = write_jsonl(tmp_path / "c.jsonl", [{"text": "x"}])
    with pytest.raises(PreprocessError, match="--eod-token '<nope>' is not in the tokenizer"):
        run_preprocess(
            [corpus], tmp_path / "o", example_tokenizer, append_eod=True, eod_token="<nope>"
        )
    with pytest.raises(PreprocessError, match="has none of <|begin_of_text|>"):
        run_preprocess([corpus], tmp_path / "o", example_tokenizer, add_bos=True)


def test_summary_and_progress_through_the_cli(tmp_path, example_corpus, example_tokenizer):
    result = cli(
        "preprocess",
        example_corpus,
        "--out",
        tmp_path / "out",
        "--tokenizer",
        example_tokenizer,
        "--append-eod",
        "--workers",
        "2",
    )
    assert result.returncode == 0, result.stderr
    assert "documents: 2,370 in, 2,370 written; skipped 0 empty, 0 duplicate, 0 invalid" in (
        result.stdout
    )
    assert "tokens/s" in result.stdout and "MB/s" in result.stdout
    assert "preprocess [" in result.stderr  # the progress line (not a terminal: logged)
    assert "ETA" in result.stderr or "total" in result.stderr


def test_help_documents_every_option_with_its_default():
    result = cli("preprocess", "--help")
    text = " ".join(result.stdout.split())
    for option in (
        "--out",
        "--tokenizer",
        "--json-keys",
        "--append-eod",
        "--eod-token",
        "--add-bos",
        "--bos-token",
        "--dtype",
        "--workers",
        "--skip-invalid",
        "--keep-empty",
        "--dedup",
        "--input-format",
        "--split",
        "--chunk-mb",
        "--quiet",
        "--json",
    ):
        assert option in text
    for default in (
        "[default: text]",
        "[default: train]",
        "[default: 1.0; 0.01<=x<=1048576]",
        "[default: all cores",
        "[default: off]",
        "[default: uint16 if the vocabulary fits, else int32]",
    ):
        assert default in text
