"""Every input format gives the same dataset for the same documents, in a stable order."""

from __future__ import annotations

import os
import subprocess

import numpy as np
import pytest
from hp_data import IndexedDataset, PreprocessError
from hp_data.readers.discovery import discover

from tests.helpers.corpus_files import WRITERS, english_records, write_jsonl, write_parquet
from tests.helpers.run import HP_DATA, read_bytes, run_preprocess


@pytest.fixture(scope="module")
def records():
    return english_records(11, 400)


@pytest.fixture(scope="module")
def reference(tmp_path_factory, records, example_tokenizer):
    directory = tmp_path_factory.mktemp("reference")
    corpus = write_jsonl(directory / "c.jsonl", records)
    run_preprocess([corpus], directory / "out", example_tokenizer, append_eod=True)
    return read_bytes(directory / "out")


@pytest.mark.slow
@pytest.mark.parametrize("fmt", [f for f in WRITERS if f != "jsonl"])
def test_every_format_gives_the_same_dataset(tmp_path, fmt, records, reference, example_tokenizer):
    source = WRITERS[fmt](tmp_path, records)
    options = {"input_format": "hf"} if fmt == "hf" else {}
    summary = run_preprocess(
        [source],
        tmp_path / "out",
        example_tokenizer,
        append_eod=True,
        chunk_bytes=4096,
        workers=2 if fmt == "jsonl.zst" else 1,
        **options,
    )
    assert read_bytes(tmp_path / "out") == reference
    assert summary.documents_in == len(records)
    assert not any(name.endswith(".hp-preprocess") for name in os.listdir(tmp_path))


def test_inputs_are_read_in_the_documented_order(tmp_path, example_tokenizer):
    shards = tmp_path / "shards"
    shards.mkdir()
    names = ["b.jsonl", "a.jsonl.gz", "c.parquet"]
    for i, name in enumerate(names):
        WRITERS[{"b.jsonl": "jsonl", "a.jsonl.gz": "jsonl.gz", "c.parquet": "parquet"}[name]](
            tmp_path, [{"text": f"document {i}"}]
        ).rename(shards / name)
    (shards / "notes.txt").write_text("ignored: not a corpus file")
    found = discover([str(shards)])
    assert [os.path.basename(s.path) for s in found] == ["a.jsonl.gz", "b.jsonl", "c.parquet"]
    assert [s.format for s in found] == ["jsonl.gz", "jsonl", "parquet"]
    by_glob = discover([str(shards / "*.jsonl"), str(shards / "c.parquet")])
    assert [os.path.basename(s.path) for s in by_glob] == ["b.jsonl", "c.parquet"]

    run_preprocess([shards], tmp_path / "out", example_tokenizer)
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(example_tokenizer))
    ds = IndexedDataset(tmp_path / "out")
    assert [tokenizer.decode(ds.get_document(d).tolist()) for d in range(3)] == [
        "document 1",
        "document 0",
        "document 2",
    ]


def test_outputs_beside_the_corpus_are_not_read_as_corpus(tmp_path, example_tokenizer):
    # hp's PREFIX.hp.json is JSON by name: a directory or glob that holds outputs skips it.
    corpus = tmp_path / "data"
    corpus.mkdir()
    (corpus / "a.json").write_text('{"text": "one"}\n')
    run_preprocess([corpus], corpus / "out", example_tokenizer)
    assert (corpus / "out.hp.json").exists()
    for spec in (corpus, corpus / "*.json"):
        assert [os.path.basename(s.path) for s in discover([str(spec)])] == ["a.json"]
    assert run_preprocess([corpus], corpus / "out", example_tokenizer).documents_in == 1


def test_unknown_inputs_are_refused(tmp_path):
    (tmp_path / "corpus.txt").write_text("x")
    with pytest.raises(PreprocessError, match="cannot tell the format from the name"):
        discover([str(tmp_path / "corpus.txt")])
    with pytest.raises(PreprocessError, match="pattern matches no files"):
        discover([str(tmp_path / "*.jsonl")])
    with pytest.raises(PreprocessError, match="no such file or directory"):
        discover([str(tmp_path / "missing.jsonl")])
    with pytest.raises(PreprocessError, match="holds no corpus files"):
        discover([str(tmp_path)])
    assert discover([str(tmp_path / "corpus.txt")], "jsonl")[0].format == "jsonl"


def test_missing_column_and_split_are_named(tmp_path, example_tokenizer):
    table = write_parquet(tmp_path / "t.parquet", [{"body": "x"}])
    with pytest.raises(PreprocessError, match=r"t.parquet: no column 'text' \(columns: body\)"):
        run_preprocess([table], tmp_path / "out", example_tokenizer)
    saved = WRITERS["hf-saved"](tmp_path, [{"text": "x"}])
    with pytest.raises(PreprocessError, match=r"no column 'title'"):
        run_preprocess([saved], tmp_path / "out", example_tokenizer, json_keys=("title",))


def test_null_values_in_tables_are_invalid_rows(tmp_path, example_tokenizer):
    table = write_parquet(tmp_path / "t.parquet", [{"text": "a"}, {"text": None}, {"text": "b"}])
    with pytest.raises(
        PreprocessError,
        match=r"t.parquet: row 2: 'text' must be a string, got "
        r"NoneType",
    ):
        run_preprocess([table], tmp_path / "out", example_tokenizer)
    summary = run_preprocess([table], tmp_path / "out", example_tokenizer, skip_invalid=True)
    assert summary.skipped["invalid"] == {"not a string": 1}
    assert summary.documents_written == 2


def test_corrupt_compressed_input(tmp_path, example_tokenizer):
    WRITERS["jsonl.gz"](tmp_path, english_records(1, 200))
    data = (tmp_path / "c.jsonl.gz").read_bytes()
    (tmp_path / "c.jsonl.gz").write_bytes(data[: len(data) // 2])
    with pytest.raises(PreprocessError, match="c.jsonl.gz: corrupt gzip data"):
        run_preprocess([tmp_path / "c.jsonl.gz"], tmp_path / "out", example_tokenizer)
    assert not (tmp_path / "out.idx").exists()


def test_a_corrupt_parquet_page_names_the_file_and_row_group(tmp_path, example_tokenizer):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(0)
    texts = [" ".join(map(str, rng.integers(0, 10**6, 30))) for _ in range(300)]
    path = tmp_path / "t.parquet"
    pq.write_table(pa.table({"text": texts}), path, row_group_size=100, use_dictionary=False)
    column = pq.ParquetFile(path).metadata.row_group(1).column(0)
    data = bytearray(path.read_bytes())
    for i in range(column.data_page_offset + 40, column.data_page_offset + 2000):
        data[i] ^= 0x5A
    path.write_bytes(data)
    with pytest.raises(
        PreprocessError, match=r"t.parquet: row group 1 \(from row 101\): corrupt Parquet data: "
    ):
        run_preprocess([path], tmp_path / "out", example_tokenizer, workers=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.parquet"]


def _zstd_frames(records: list[dict], frames: int, **options) -> bytes:
    import json

    import zstandard

    lines = [json.dumps(r) + "\n" for r in records]
    step = -(-len(lines) // frames)
    compressor = zstandard.ZstdCompressor(**options)
    parts = ["".join(lines[i : i + step]).encode() for i in range(0, len(lines), step)]
    return b"".join(compressor.compress(part) for part in parts)


@pytest.mark.parametrize("skip_invalid", [False, True])
@pytest.mark.parametrize("keep", [0.1, 0.5, 0.9, 0.999])
def test_a_truncated_zstd_file_is_refused(tmp_path, example_tokenizer, keep, skip_invalid):
    # zstandard's reader ends quietly where a frame is cut: hp must not lose the tail unnoticed.
    data = _zstd_frames(english_records(1, 400), frames=3, write_checksum=True)
    (tmp_path / "c.jsonl.zst").write_bytes(data[: int(len(data) * keep)])
    with pytest.raises(PreprocessError, match=r"c.jsonl.zst: corrupt zstd data: truncated zstd"):
        run_preprocess(
            [tmp_path / "c.jsonl.zst"],
            tmp_path / "out",
            example_tokenizer,
            skip_invalid=skip_invalid,
        )
    assert not (tmp_path / "out.idx").exists()


@pytest.mark.parametrize(
    "options",
    [
        {"frames": 1},
        {"frames": 4, "write_checksum": True},
        {"frames": 2, "write_content_size": False, "level": 19},
    ],
)
def test_complete_zstd_files_of_every_shape_read_whole(tmp_path, example_tokenizer, options):
    records = english_records(2, 300)
    frames = options.pop("frames")
    skippable = (0x184D2A53).to_bytes(4, "little") + (5).to_bytes(4, "little") + b"hello"
    (tmp_path / "c.jsonl.zst").write_bytes(skippable + _zstd_frames(records, frames, **options))
    write_jsonl(tmp_path / "plain.jsonl", records)
    run_preprocess([tmp_path / "c.jsonl.zst"], tmp_path / "zst", example_tokenizer)
    run_preprocess([tmp_path / "plain.jsonl"], tmp_path / "plain", example_tokenizer)
    assert read_bytes(tmp_path / "zst") == read_bytes(tmp_path / "plain")


@pytest.mark.parametrize(
    ("fmt", "module", "extra"), [("hf-saved", "datasets", "hf"), ("parquet", "pyarrow", "parquet")]
)
def test_a_missing_optional_dependency_names_the_extra(
    tmp_path, example_tokenizer, fmt, module, extra
):
    import subprocess
    import sys
    import textwrap

    source = WRITERS[fmt](tmp_path, [{"text": "x"}])
    script = textwrap.dedent(f"""
        import sys
        sys.modules[{module!r}] = None  # as if it were not installed
        from hp_data.cli import main
        main(["preprocess", {str(source)!r}, "--out", {str(tmp_path / "out")!r},
              "--tokenizer", {str(example_tokenizer)!r}, "--quiet"])
    """)
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 1
    assert f"needs {module}: pip install 'hp-data[{extra}]'" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("fmt", ["jsonl", "jsonl.gz"])
def test_standard_input_streams_to_the_same_bytes_as_the_file(tmp_path, example_tokenizer, fmt):
    source = WRITERS[fmt](tmp_path, english_records(3, 300))
    run_preprocess([source], tmp_path / "file", example_tokenizer)
    result = subprocess.run(
        [HP_DATA, "preprocess", "-", "--input-format", fmt, "--out", tmp_path / "piped"]
        + ["--tokenizer", example_tokenizer, "--workers", "2", "--chunk-mb", "0.01"],
        input=source.read_bytes(),
        capture_output=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert read_bytes(tmp_path / "piped") == read_bytes(tmp_path / "file")
    bad = subprocess.run(
        [HP_DATA, "preprocess", "-", "--out", tmp_path / "bad", "--tokenizer", example_tokenizer],
        input=b'{"text": "fine"}\n{"text": 1}\n',
        capture_output=True,
        timeout=120,
    )
    assert bad.returncode == 1
    assert bad.stderr.decode().strip() == "Error: <stdin>:2: 'text' must be a string, got int"


def test_a_pipe_or_device_path_is_refused_not_read_as_empty(tmp_path, example_tokenizer):
    fifo = tmp_path / "fifo.jsonl"
    os.mkfifo(fifo)
    for path in (fifo, "/dev/null"):
        with pytest.raises(PreprocessError, match="not a regular file .* standard input as -"):
            run_preprocess([path], tmp_path / "out", example_tokenizer, input_format="jsonl")
    with pytest.raises(PreprocessError, match="standard input .* not jsonl.zst"):
        run_preprocess(["-"], tmp_path / "out", example_tokenizer, input_format="jsonl.zst")


def test_an_input_named_twice_is_read_once_where_first_named(
    tmp_path, example_tokenizer, monkeypatch
):
    """Other spellings, links, and a directory and glob over files already named: each
    document once (Megatron users expect it), in first-named order, with one warning a name."""
    monkeypatch.chdir(tmp_path)  # relative names, as typed
    write_jsonl(tmp_path / "f1.jsonl", english_records(1, 3))
    (tmp_path / "dir").mkdir()
    for name, seed in (("a", 2), ("b", 3)):
        write_jsonl(tmp_path / "dir" / f"{name}.jsonl", english_records(seed, 3))
    os.symlink("f1.jsonl", "link.jsonl")
    os.link("f1.jsonl", "hard.jsonl")
    named = ["f1.jsonl", "./f1.jsonl", "link.jsonl", "hard.jsonl", "dir", "dir/*.jsonl"]
    named += ["dir/b.jsonl", "f1.jsonl"]
    result = subprocess.run(
        [HP_DATA, "preprocess", *named, "--out", "twice", "--tokenizer", example_tokenizer]
        + ["--workers", "1", "--quiet"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert result.stderr.splitlines() == [
        f"Warning: {name}: {what}; read once, where first named"
        for name, what in [
            ("./f1.jsonl", "the same input as f1.jsonl"),
            ("link.jsonl", "the same input as f1.jsonl"),
            ("hard.jsonl", "the same input as f1.jsonl"),
            ("dir/*.jsonl", "holds 2 inputs named before (dir/a.jsonl, dir/b.jsonl)"),
            ("dir/b.jsonl", "already in dir"),
            ("f1.jsonl", "named more than once"),
        ]
    ]
    # The reference: a run over each file once.
    once = ["f1.jsonl", "dir/a.jsonl", "dir/b.jsonl"]
    run_preprocess(once, tmp_path / "once", example_tokenizer)
    assert read_bytes(tmp_path / "twice") == read_bytes(tmp_path / "once")


def test_urls_and_standard_input_named_twice_are_read_once(tmp_path):
    import fsspec

    fs = fsspec.filesystem("memory")
    for name in ("a", "b"):
        fs.pipe(f"/twice/{name}.jsonl", b'{"text": "x"}\n')
    with pytest.warns(UserWarning) as caught:
        found = discover(["memory://twice/a.jsonl", "memory:///twice/", "-", "-"])
    assert [s.path for s in found] == ["memory://twice/a.jsonl", "memory:///twice/b.jsonl", "-"]
    # memory:// objects have no strong validator, which is warned about too (remote.py).
    assert [str(w.message) for w in caught if "read once" in str(w.message)] == [
        "memory:///twice/: holds 1 input named before (memory:///twice/a.jsonl); "
        "read once, where first named",
        "-: named more than once; read once, where first named",
    ]


def test_urls_that_differ_in_a_secret_parameter_and_file_urls_are_told_apart_rightly(tmp_path):
    """Two objects whose URLs differ only in a value that is redacted when shown (`?key=`) are
    two inputs; a `file://` URL of a local file is that file, read once."""
    import fsspec

    fs = fsspec.filesystem("memory")
    urls = ["memory://keys/dl?key=a", "memory://keys/dl?key=b"]
    for url in urls:  # memory:// keeps the query in the name: two objects
        fs.pipe(url, b'{"text": "x"}\n')
    with pytest.warns(UserWarning) as caught:  # memory:// objects have no strong validator
        found = discover(urls, "jsonl")
    assert [s.path for s in found] == [url.replace("://", ":///") for url in urls]
    assert not [w for w in caught if "read once" in str(w.message)]
    local = tmp_path / "a.jsonl"
    local.write_text('{"text": "x"}\n')
    with pytest.warns(UserWarning) as caught:
        found = discover([str(local), f"file://{local}"])
    assert [s.path for s in found] == [str(local)]
    assert [str(w.message) for w in caught] == [
        f"file://{local}: holds 1 input named before ({local}); read once, where first named"
    ]
