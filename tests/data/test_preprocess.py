"""`preprocess` writes exactly the tokenizer's ids, skips empty documents, and fails cleanly."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from hp_data import IndexedDataset, PreprocessError
from hp_data.preprocess import preprocess
from tokenizers import Tokenizer, models, pre_tokenizers


def _jsonl(path: Path, lines: list[object]) -> str:
    path.write_text("".join(json.dumps(x) + "\n" for x in lines), encoding="utf-8")
    return str(path)


def test_ids_equal_the_tokenizers_own_plus_eod(tmp_path, example_corpus, example_tokenizer):
    summary = preprocess(
        [str(example_corpus)],
        str(tmp_path / "out"),
        str(example_tokenizer),
        append_eod=True,
        show_progress=False,
    )
    tokenizer = Tokenizer.from_file(str(example_tokenizer))
    eod = tokenizer.token_to_id("<|endoftext|>")
    texts = [json.loads(line)["text"] for line in example_corpus.open(encoding="utf-8")]
    ds = IndexedDataset(tmp_path / "out")
    assert ds.dtype == np.uint16  # 8192-token vocabulary
    assert ds.num_documents == len(texts) == summary.documents_written
    assert summary.tokens == ds.num_tokens
    for d, text in enumerate(texts):
        expected = tokenizer.encode(text, add_special_tokens=False).ids + [eod]
        assert ds.get_document(d).tolist() == expected
    # One sequence per document, as Megatron's preprocess_data.py writes.
    assert ds.document_indices.tolist() == list(range(len(texts) + 1))


def test_empty_documents_are_skipped_and_counted(tmp_path, example_tokenizer):
    corpus = _jsonl(tmp_path / "c.jsonl", [{"text": "hello world"}, {"text": ""}, {"text": "x"}])
    summary = preprocess(
        [corpus],
        str(tmp_path / "out"),
        str(example_tokenizer),
        append_eod=True,
        show_progress=False,
    )
    assert (summary.documents_in, summary.documents_written, summary.empty_skipped) == (3, 2, 1)
    assert IndexedDataset(tmp_path / "out").num_documents == 2


def test_several_inputs_are_written_in_order(tmp_path, example_tokenizer):
    a = _jsonl(tmp_path / "a.jsonl", [{"text": "first"}])
    b = _jsonl(tmp_path / "b.jsonl", [{"text": "second"}, {"text": "third"}])
    preprocess([a, b], str(tmp_path / "out"), str(example_tokenizer), show_progress=False)
    tokenizer = Tokenizer.from_file(str(example_tokenizer))
    ds = IndexedDataset(tmp_path / "out")
    assert [tokenizer.decode(ds.get_document(d).tolist()) for d in range(3)] == [
        "first",
        "second",
        "third",
    ]


def test_a_large_vocabulary_gets_int32(tmp_path):
    vocab = {f"w{i}": i for i in range(70_000)}
    vocab["[UNK]"] = 70_000
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(tmp_path / "tok.json"))
    corpus = _jsonl(tmp_path / "c.jsonl", [{"text": "w1 w69999 w65536 nope"}])
    summary = preprocess(
        [corpus], str(tmp_path / "out"), str(tmp_path / "tok.json"), show_progress=False
    )
    assert summary.dtype == "int32"
    assert IndexedDataset(tmp_path / "out")[0].tolist() == [1, 69999, 65536, 70000]
    with pytest.raises(PreprocessError, match="--dtype uint16 cannot hold ids of a 70001-token"):
        preprocess([corpus], str(tmp_path / "o2"), str(tmp_path / "tok.json"), dtype="uint16")


BAD_LINES = [
    (b'{"text": "ok"}\n{"text": "broken\n', "malformed JSON: Unterminated string"),
    (b'{"text": "ok"}\n["a list"]\n', "expected a JSON object, got list"),
    (b'{"text": "ok"}\n{"body": "no text"}\n', "missing key 'text'"),
    (b'{"text": "ok"}\n{"text": 42}\n', "'text' must be a string, got int"),
    (b'{"text": "ok"}\n{"text": "caf\xe9"}\n', "invalid UTF-8 at byte 13 of the line"),
]


@pytest.mark.parametrize(("content", "reason"), BAD_LINES)
def test_a_bad_line_stops_with_file_and_line(tmp_path, example_tokenizer, content, reason):
    corpus = tmp_path / "bad.jsonl"
    corpus.write_bytes(b'{"text": "fine"}\n\n' + content)
    with pytest.raises(PreprocessError) as caught:
        preprocess(
            [str(corpus)], str(tmp_path / "out"), str(example_tokenizer), show_progress=False
        )
    assert str(caught.value).startswith(f"{corpus}:4: {reason}")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.jsonl"]


def test_missing_eod_token_is_named(tmp_path, example_tokenizer):
    corpus = _jsonl(tmp_path / "c.jsonl", [{"text": "x"}])
    with pytest.raises(PreprocessError, match="--eod-token '<nope>' is not in the tokenizer"):
        preprocess(
            [corpus],
            str(tmp_path / "out"),
            str(example_tokenizer),
            append_eod=True,
            eod_token="<nope>",
        )


def test_bad_tokenizer_file(tmp_path):
    corpus = _jsonl(tmp_path / "c.jsonl", [{"text": "x"}])
    (tmp_path / "tok.json").write_text("{not json")
    with pytest.raises(PreprocessError, match="tok.json: not a valid tokenizers model"):
        preprocess([corpus], str(tmp_path / "out"), str(tmp_path / "tok.json"))
    with pytest.raises(PreprocessError, match="no such tokenizer file"):
        preprocess([corpus], str(tmp_path / "out"), str(tmp_path / "missing.json"))
