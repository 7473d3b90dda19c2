"""Hostile corpora through every input format, 1 and 2 workers, with and without
--skip-invalid: either `file:line: reason` and nothing at the final path, or every good record
written (ids equal to `tokenizers`' own) and every bad one counted by its reason. Never a
silent loss, never a hang (each test runs under a timeout)."""

from __future__ import annotations

import os

import pytest
from hp_data import IndexedDataset, PreprocessError
from tokenizers import Tokenizer

from tests.helpers.hostile import hostile_lines, hostile_table, truncate, write_hostile
from tests.helpers.run import run_preprocess

CHUNK = 1 << 16  # small chunks: the enormous line spans several, bad lines land in many


def _reference(tokenizer, texts: list[str]) -> list[list[int]]:
    loaded = Tokenizer.from_file(str(tokenizer))
    return [e.ids for e in loaded.encode_batch(texts, add_special_tokens=False)]


def _written(prefix) -> list[list[int]]:
    with IndexedDataset(prefix) as dataset:
        return [dataset.get_document(d).tolist() for d in range(dataset.num_documents)]


def _nothing_at(out) -> None:
    directory, name = os.path.split(out)
    assert not [f for f in os.listdir(directory) if f.startswith((name, f".{name}"))]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("workers", [1, 2])
@pytest.mark.parametrize("fmt", ["jsonl", "jsonl.gz", "jsonl.zst"])
def test_hostile_json_lines(tmp_path, example_tokenizer, fmt, workers):
    corpus = hostile_lines(seed=len(fmt) + workers)
    path = write_hostile(tmp_path, corpus, fmt)
    out = str(tmp_path / "out")
    line, _ = corpus.first_bad_line()
    with pytest.raises(PreprocessError, match=f"^{path}:{line}: "):
        run_preprocess([path], out, example_tokenizer, workers=workers, chunk_bytes=CHUNK)
    _nothing_at(out)

    summary = run_preprocess(
        [path], out, example_tokenizer, workers=workers, chunk_bytes=CHUNK, skip_invalid=True
    )
    assert summary.skipped["invalid"] == corpus.counts()
    assert summary.documents_written == len(corpus.texts)
    assert _written(out) == _reference(example_tokenizer, corpus.texts)


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("fmt", "workers"), [("parquet", 1), ("parquet", 2), ("hf-saved", 1)])
def test_hostile_tables(tmp_path, example_tokenizer, fmt, workers):
    path, values, texts = hostile_table(tmp_path, seed=workers)
    if fmt == "hf-saved":
        import datasets

        path = tmp_path / "saved"
        datasets.Dataset.from_dict({"text": values}).save_to_disk(str(path))
    out = str(tmp_path / "out")
    first_null = values.index(None) + 1
    with pytest.raises(PreprocessError, match=f"^{path}: row {first_null}: 'text' must be a"):
        run_preprocess([path], out, example_tokenizer, workers=workers)
    _nothing_at(out)
    summary = run_preprocess([path], out, example_tokenizer, workers=workers, skip_invalid=True)
    assert summary.skipped["invalid"] == {"not a string": values.count(None)}
    assert _written(out) == _reference(example_tokenizer, texts)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("skip_invalid", [False, True])
@pytest.mark.parametrize("fmt", ["jsonl.gz", "jsonl.zst", "parquet"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_file_cut_anywhere_is_refused_never_read_short(
    tmp_path, example_tokenizer, fmt, seed, skip_invalid
):
    if fmt == "parquet":
        path = hostile_table(tmp_path, seed)[0]
    else:
        path = write_hostile(tmp_path, hostile_lines(seed), fmt)
    truncate(path, seed)
    out = str(tmp_path / "out")
    with pytest.raises(PreprocessError) as caught:
        run_preprocess([path], out, example_tokenizer, chunk_bytes=CHUNK, skip_invalid=skip_invalid)
    # A bad line before the cut may be reported first (without --skip-invalid); the cut
    # itself is never skipped as a line would be.
    message = str(caught.value)
    assert message.startswith(f"{path}:")
    if skip_invalid:
        assert "corrupt" in message or "not a readable Parquet" in message, message
    _nothing_at(out)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("bad", ["not json", "a directory", "dropout"])
def test_a_bad_tokenizer_with_workers_started_stops_at_once(
    tmp_path, example_tokenizer, example_corpus, bad
):
    """The workers start before the tokenizer loads (pipeline/worker.py's `Workers`): a
    tokenizer refused after that stops the run in one line, nothing written, and the workers
    are let go (the test's timeout would catch a pool left waiting)."""
    import json

    from tests.helpers.run import cli

    tokenizer = tmp_path / "tokenizer.json"
    if bad == "not json":
        tokenizer.write_text("{ this is not json")
    elif bad == "a directory":
        tokenizer = tmp_path / "empty-dir"
        tokenizer.mkdir()
    else:
        described = json.loads(example_tokenizer.read_text())
        described["model"]["dropout"] = 0.1
        tokenizer.write_text(json.dumps(described))
    out = tmp_path / "out"
    done = cli("preprocess", example_corpus, "--out", out, "--tokenizer", tokenizer,
               "--workers", "2", "--quiet", timeout=50)  # fmt: skip
    assert done.returncode == 1
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr
    assert str(tokenizer.name) in done.stderr
    _nothing_at(out)
