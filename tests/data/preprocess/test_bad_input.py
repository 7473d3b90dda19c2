"""Bad lines stop the run with `file:line: reason` (or are counted with --skip-invalid)."""

from __future__ import annotations

import json
import os

import pytest
from hp_data import IndexedDataset, PreprocessError

from tests.helpers.run import cli, run_preprocess

BAD_LINES = [
    (b'{"text": "broken\n', "malformed JSON", "malformed JSON: Unterminated string starting at"),
    (b'["a list"]\n', "not an object", "expected a JSON object, got list"),
    (b'{"body": "no text"}\n', "missing key", "missing key 'text'"),
    (b'{"text": 42}\n', "not a string", "'text' must be a string, got int"),
    (b'{"text": "caf\xe9"}\n', "invalid UTF-8", "invalid UTF-8 at byte 13 of the line"),
    # Lone surrogates, escaped or as raw bytes (json.loads lets both through): no tokenizer
    # can encode them.
    (b'{"text": "a\\ud800b"}\n', "lone surrogate", "'text' holds a lone surrogate at character 1"),
    (b'{"text": "raw \xed\xa0\x80"}\n', "lone surrogate", "'text' holds a lone surrogate at"),
    # Valid JSON that json.loads refuses with other errors than a decode error.
    (b'{"n": ' + b"9" * 5000 + b"}\n", "number too long", "a JSON number too long to read"),
    (b"[" * 100_000 + b"\n", "nested too deeply", "JSON nested too deeply to parse"),
]


def _corpus(path, bad: bytes, good_before: int = 300) -> str:
    lines = [json.dumps({"text": f"line {i}"}).encode() + b"\n" for i in range(good_before)]
    path.write_bytes(
        b"".join(lines[:100]) + b"\n" + b"".join(lines[100:]) + bad + b'{"text": "after"}\n'
    )
    return str(path)


@pytest.mark.parametrize(("bad", "kind", "reason"), BAD_LINES, ids=[b[1] for b in BAD_LINES])
@pytest.mark.parametrize("workers", [1, 2])
def test_a_bad_line_stops_with_file_and_line(
    tmp_path, example_tokenizer, bad, kind, reason, workers
):
    corpus = _corpus(tmp_path / "bad.jsonl", bad)
    with pytest.raises(PreprocessError) as caught:
        # Small chunks put the bad line deep in a later chunk: its number must still be right.
        run_preprocess(
            [corpus], tmp_path / "out", example_tokenizer, workers=workers, chunk_bytes=1000
        )
    assert str(caught.value).startswith(f"{corpus}:302: {reason}")
    assert sorted(os.listdir(tmp_path)) == ["bad.jsonl"]  # no output, no work directory


def test_the_cli_exits_1_with_one_line(tmp_path, example_tokenizer):
    corpus = _corpus(tmp_path / "bad.jsonl", b'{"text": 42}\n', good_before=5)
    result = cli("preprocess", corpus, "--out", tmp_path / "out", "--tokenizer", example_tokenizer)
    assert result.returncode == 1
    assert result.stderr.strip().splitlines()[-1] == (
        f"Error: {corpus}:7: 'text' must be a string, got int"
    )
    assert "Traceback" not in result.stderr
    assert sorted(os.listdir(tmp_path)) == ["bad.jsonl"]


def test_a_missing_key_names_the_cli_flag(tmp_path, example_tokenizer):
    """hp-data's CLI chooses keys with --json-keys (hp-train names its own key instead)."""
    corpus = _corpus(tmp_path / "bad.jsonl", b'{"body": "no text"}\n', good_before=5)
    result = cli("preprocess", corpus, "--out", tmp_path / "out", "--tokenizer", example_tokenizer)
    assert result.returncode == 1
    assert result.stderr.strip().splitlines()[-1] == (
        f"Error: {corpus}:7: missing key 'text' (choose keys with --json-keys)"
    )


def test_skip_invalid_counts_each_reason_and_shows_where(tmp_path, example_tokenizer):
    lines = [b'{"text": "good"}\n']
    for bad, _, _ in BAD_LINES:
        lines += [bad, b'{"text": "good"}\n']
    lines.append(b'{"text": 1}\n')
    corpus = tmp_path / "mixed.jsonl"
    corpus.write_bytes(b"".join(lines))
    summary = run_preprocess(
        [corpus], tmp_path / "out", example_tokenizer, skip_invalid=True, chunk_bytes=30, workers=2
    )
    assert summary.skipped["invalid"] == {
        "malformed JSON": 1,
        "not an object": 1,
        "missing key": 1,
        "not a string": 2,
        "invalid UTF-8": 1,
        "lone surrogate": 2,
        "number too long": 1,
        "nested too deeply": 1,
    }
    assert summary.documents_written == len(BAD_LINES) + 1
    assert IndexedDataset(tmp_path / "out").num_documents == len(BAD_LINES) + 1
    for i, (_, _, reason) in enumerate(BAD_LINES[:5]):  # the summary keeps five examples
        assert summary.invalid_examples[i].startswith(f"{corpus}:{2 * i + 2}: {reason}")
    result = cli(
        "preprocess",
        corpus,
        "--out",
        tmp_path / "o2",
        "--tokenizer",
        example_tokenizer,
        "--skip-invalid",
        "--quiet",
    )
    assert result.returncode == 0
    assert (
        "10 invalid (1 malformed JSON, 1 not an object, 1 missing key, 2 not a string, "
        "1 invalid UTF-8, 2 lone surrogate, 1 number too long, 1 nested too deeply)"
        in result.stdout
    )
    assert f"invalid: {corpus}:2: malformed JSON" in result.stdout


def test_bad_tokenizer_files(tmp_path):
    corpus = tmp_path / "c.jsonl"
    corpus.write_text('{"text": "x"}\n')
    (tmp_path / "tok.json").write_text("{not json")
    with pytest.raises(PreprocessError, match="tok.json: not a valid tokenizers model"):
        run_preprocess([corpus], tmp_path / "out", tmp_path / "tok.json")
    with pytest.raises(PreprocessError, match="no such tokenizer file"):
        run_preprocess([corpus], tmp_path / "out", tmp_path / "missing.json")
