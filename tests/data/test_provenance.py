"""Provenance: every document of a preprocessed dataset back to the raw record it came from.

The reference is rebuilt here from the raw files alone: the test reads each input itself
(json / gzip / zstandard / pyarrow / datasets), keeps the records hp-data's documented rules
keep (a JSON object with a string text, not blank, not tokenizing to nothing, not a text seen
before with --dedup exact), tokenizes them with `tokenizers` directly, and expects the
`.bin` to be exactly those tokens and document i's source to be the i-th such record — never
through hp's `.idx` or sidecar. Shards, their merge, `merge` of datasets, samples of a
GPTDataset and of a blend, damaged sidecars and a kill at every step of a commit too.
"""

from __future__ import annotations

import gzip
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from hp_data import HpDataError, IndexedDataset
from hp_data.blend import BlendableDataset
from hp_data.cli import main
from hp_data.gpt import GPTDataset, GPTDatasetConfig
from hp_data.merge import merge_datasets
from hp_data.provenance import (
    ProvenanceError,
    document_input,
    document_source,
    read_provenance,
    sample_pieces,
    source_text,
)
from hp_data.shards import merge_shards
from hp_data.summary import provenance_report
from tokenizers import Tokenizer

from tests.helpers.corpus import random_corpus, write_with_hp
from tests.helpers.corpus_files import (
    english_records,
    save_hf,
    write_jsonl_gz,
    write_jsonl_zst,
    write_parquet,
)
from tests.helpers.run import run_preprocess

ROOT = Path(__file__).resolve().parents[2]
BAD_LINES = ['{"text": ', '["not", "an", "object"]', '{"title": "no text key"}', '{"text": 7}']


def _write_messy_jsonl(path: Path, records: list[dict], seed: int) -> Path:
    """Records as JSON lines with blank lines and bad lines between them (seeded)."""
    rng = np.random.default_rng(seed)
    lines = []
    for record in records:
        roll = rng.random()
        if roll < 0.06:
            lines.append("   " if roll < 0.02 else "")
        elif roll < 0.12:
            lines.append(BAD_LINES[int(rng.integers(len(BAD_LINES)))])
        lines.append(json.dumps(record, ensure_ascii=False))
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def _raw_records(path: Path) -> list[tuple[dict, object]]:
    """(source, record) of every raw record of an input, read here, in file order."""
    name = str(path.resolve())
    if path.is_dir():  # a saved HF dataset
        import datasets

        rows = datasets.load_from_disk(name)
        return [({"dataset": name, "index": i}, dict(row)) for i, row in enumerate(rows)]
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        rows = pq.read_table(path).to_pylist()
        return [({"file": name, "row": i + 1}, row) for i, row in enumerate(rows)]
    if path.suffix == ".gz":
        data = gzip.decompress(path.read_bytes())
    elif path.suffix == ".zst":
        import zstandard

        data = zstandard.ZstdDecompressor().stream_reader(path.read_bytes()).read()
    else:
        data = path.read_bytes()
    found = []
    for number, line in enumerate(data.decode().split("\n")[: data.count(b"\n")], 1):
        try:
            record = json.loads(line) if line.strip() else None
        except ValueError:
            record = None
        found.append(({"file": name, "line": number}, record))
    return found


def _reference(inputs: list[Path], tokenizer: Tokenizer, dedup: bool = True) -> list[tuple]:
    """(source, text, ids) of every document a run over `inputs` writes, in order."""
    documents, seen = [], set()
    for path in inputs:
        for source, record in _raw_records(path):
            if not isinstance(record, dict) or not isinstance(record.get("text"), str):
                continue  # blank, malformed, no object, no text: skipped (--skip-invalid)
            ids = tokenizer.encode(record["text"], add_special_tokens=False).ids
            if not ids or (dedup and record["text"] in seen):
                continue
            seen.add(record["text"])
            documents.append((source, record["text"], ids))
    return documents


@pytest.fixture(scope="module")
def memory_dir(tmp_path_factory):
    """A directory in memory where there is one (/dev/shm): every commit syncs its files,
    and on a disk those syncs are most of these tiny runs' time."""
    shm = Path("/dev/shm")
    if not (shm.is_dir() and os.access(shm, os.W_OK)):
        yield tmp_path_factory.mktemp("provenance")
        return
    path = Path(tempfile.mkdtemp(prefix="hp-provenance-", dir=shm))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def corpus(memory_dir, example_tokenizer):
    """Inputs of every file format, with bad, blank, empty and repeated records, some
    repeated across inputs, and the reference documents of a run over them."""
    root = memory_dir / "corpus"
    root.mkdir()
    records = english_records(25, 560)
    for i in range(0, 560, 37):  # documents repeated in later inputs
        records[i + 1]["text"] = records[i]["text"]
    parquet_rows = [dict(r) for r in records[360:440]]
    parquet_rows[5]["text"] = None  # not a string: an invalid row
    inputs = [
        _write_messy_jsonl(root / "a.jsonl", records[:300], seed=1),
        write_jsonl_gz(root / "b.jsonl.gz", records[280:330] + records[:8]),
        write_jsonl_zst(root / "c.jsonl.zst", records[330:360]),
        write_parquet(root / "d.parquet", parquet_rows, row_group_size=30),
    ]
    tokenizer = Tokenizer.from_file(str(example_tokenizer))
    reference = _reference(inputs, tokenizer)
    out = root / "out" / "corpus"
    options = {"skip_invalid": True, "dedup": "exact", "unit_bytes": 2500, "tokenizer_engine": "hf"}
    summary = run_preprocess(inputs, out, example_tokenizer, **options)
    units = read_provenance(str(out)).units
    assert (units[:, 0] == 0).sum() > 3 and (units[:, 0] == 3).sum() > 1  # .jsonl, .parquet
    assert summary.documents_written == len(reference)
    return {"root": root, "inputs": inputs, "reference": reference, "out": out,
            "options": options, "tokenizer": tokenizer}  # fmt: skip


def _tokens_of_bin(prefix: Path) -> np.ndarray:
    """The `.bin` read raw, without its `.idx`."""
    return np.fromfile(f"{prefix}.bin", np.uint16)


def test_each_document_traces_to_its_raw_record(corpus):
    reference, out = corpus["reference"], corpus["out"]
    expected_tokens = np.concatenate([np.array(ids, np.uint16) for _, _, ids in reference])
    np.testing.assert_array_equal(_tokens_of_bin(out), expected_tokens)
    sources = document_source(str(out), np.arange(len(reference)))
    assert sources == [source for source, _, _ in reference]
    assert {tuple(s) for s in sources} == {("file", "line"), ("file", "row")}
    # The text of one document of each input, read back from the raw input (a streamed
    # decompression, a Parquet row group, an HF row).
    firsts = {}
    for number, (source, text, _) in enumerate(reference):
        firsts.setdefault(source.get("file", source.get("dataset")), (number, text))
    for number, text in firsts.values():
        assert source_text(sources[number], limit=40) == text[:40]
    parquet = firsts[str(corpus["inputs"][-1].resolve())][0]
    assert document_input(str(out), parquet)["format"] == "parquet"
    report = provenance_report(str(out))
    assert report["inputs"] == 4 and report["skipped"]["duplicate"] > 0
    assert report["skipped"]["invalid"] > 0 and report["skipped"]["blank"] > 0
    assert report["skipped"]["empty"] > 0


def test_shards_and_their_merge_trace_the_same_records(corpus, example_tokenizer):
    """Three shards (byte ranges of one file cut across them), each traceable alone, and
    their merge, which drops duplicates across shards, equal to the one-machine sources."""
    out = corpus["root"] / "sharded" / "corpus"
    inputs = corpus["inputs"]
    reference = corpus["reference"]
    for index in range(3):
        run_preprocess(
            inputs, out, example_tokenizer, num_shards=3, shard_index=index, **corpus["options"]
        )
    middle = f"{out}.shard-00001-of-00003"
    units = read_provenance(middle).units
    assert units[0, 2] == -1  # a byte range whose earlier lines this shard never read
    with IndexedDataset(middle) as shard:
        sources = document_source(middle, np.arange(shard.num_documents))
        raw = {(s.get("file"), s.get("line"), s.get("row")): r for path in inputs
               for s, r in _raw_records(path)}  # fmt: skip
        for number, source in enumerate(sources):
            record = raw[(source.get("file"), source.get("line"), source.get("row"))]
            ids = corpus["tokenizer"].encode(record["text"], add_special_tokens=False).ids
            assert shard.get_document(number).tolist() == ids, source
    merged = merge_shards(str(out))
    assert merged["duplicates_across_shards"] > 0
    assert document_source(str(out), np.arange(len(reference))) == [s for s, _, _ in reference]
    np.testing.assert_array_equal(
        _tokens_of_bin(out), np.concatenate([np.array(i, np.uint16) for _, _, i in reference])
    )
    assert (read_provenance(str(out)).units[:, 2] >= 0).all()  # every first line resolved


@pytest.mark.filterwarnings("ignore:.*no ETag, version id or content hash")
def test_url_inputs_trace_to_their_urls(corpus, example_tokenizer):
    """The same inputs behind fsspec URLs (memory://, in this process): the same documents,
    each named by its URL, its text read back through the URL."""
    import fsspec

    fs = fsspec.filesystem("memory")
    urls = []
    for path in corpus["inputs"]:
        fs.pipe(f"/provenance/{path.name}", path.read_bytes())
        urls.append(f"memory:///provenance/{path.name}")
    out = corpus["root"] / "url-out" / "corpus"
    run_preprocess(urls, out, example_tokenizer, **corpus["options"])
    named = {str(path.resolve()): url for path, url in zip(corpus["inputs"], urls, strict=True)}
    expected = [{**s, "file": named[s["file"]]} for s, _, _ in corpus["reference"]]
    sources = document_source(str(out), range(len(expected)))
    assert sources == expected
    assert source_text(sources[-1]) == corpus["reference"][-1][1][:200]  # a Parquet row
    assert source_text(sources[0]) == corpus["reference"][0][1][:200]
    fs.rm("/provenance", recursive=True)


def test_an_hf_dataset_traces_to_its_index(corpus, example_tokenizer):
    records = english_records(7, 60)
    records[9]["text"] = records[3]["text"]
    saved = save_hf(corpus["root"] / "hf", [{"text": r["text"]} for r in records])
    reference = _reference([saved], corpus["tokenizer"])
    out = corpus["root"] / "hf-out" / "corpus"
    run_preprocess([saved], out, example_tokenizer, dedup="exact", tokenizer_engine="hf")
    sources = document_source(str(out), range(len(reference)))
    assert sources == [source for source, _, _ in reference]
    assert len(reference) < len(records)  # empty and repeated rows skipped
    assert source_text(sources[-1]) == reference[-1][1][:200]


def test_merge_offsets_ids_and_a_megatron_made_dataset_has_ids_only(corpus, tmp_path):
    plain = tmp_path / "plain"
    write_with_hp(str(plain), random_corpus(3, max_documents=40))
    with IndexedDataset(str(plain)) as dataset:
        count = dataset.num_documents
    assert read_provenance(str(plain)) is None and provenance_report(str(plain)) is None
    assert document_source(str(plain), range(count)) == [None] * count
    # Its samples still map to documents: documents of several sequences, some empty.
    config = GPTDatasetConfig(seq_length=16, split="100,0,0", cache_dir=str(tmp_path))
    dataset = GPTDataset(str(plain), "train", 40, config)
    with IndexedDataset(str(plain)) as opened:
        for index in range(len(dataset)):
            pieces = sample_pieces(dataset, index)
            tokens = [opened.get_document(p["document"])[slice(*p["tokens"])] for p in pieces]
            assert np.concatenate(tokens).tolist() == dataset.sample_tokens(index)[0].tolist()
    merged = tmp_path / "merged"
    merge_datasets(str(merged), [str(corpus["out"]), str(plain), str(corpus["out"])])
    expected = [source for source, _, _ in corpus["reference"]]
    total = 2 * len(expected) + count
    assert document_source(str(merged), range(total)) == expected + [None] * count + expected
    merge_datasets(str(merged), [str(plain)])  # rewritten without provenance: the old goes
    assert not Path(f"{merged}.hp.sources").exists()


def test_sample_pieces_cut_samples_from_raw_records(corpus, tmp_path):
    """Every sample of a GPTDataset and of a blend, rebuilt from the raw records' own
    tokenization through its pieces' sources, is the sample's tokens."""
    out, reference = str(corpus["out"]), corpus["reference"]
    ids_of = {json.dumps(source, sort_keys=True): ids for source, _, ids in reference}
    config = GPTDatasetConfig(seq_length=16, split="100,0,0", cache_dir=str(tmp_path))
    dataset = GPTDataset(out, "train", 150, config)

    def rebuilt(pieces: list[dict]) -> list[int]:
        tokens = []
        sources = document_source(out, [piece["document"] for piece in pieces])
        for piece, source in zip(pieces, sources, strict=True):
            start, end = piece["tokens"]
            tokens += ids_of[json.dumps(source, sort_keys=True)][start:end]
        return tokens

    for index in range(len(dataset)):
        pieces = sample_pieces(dataset, index)
        assert {p["corpus"] for p in pieces} == {out}
        tokens, _ = dataset.sample_tokens(index)
        assert rebuilt(pieces) == tokens.tolist()  # no padding: 150 samples fit
    other = GPTDataset(
        out, "train", 100, GPTDatasetConfig(17, 9, "100,0,0", cache_dir=str(tmp_path))
    )
    blend = BlendableDataset([dataset, other], [0.7, 0.3], 60, "train", cache_dir=str(tmp_path))
    for index in range(len(blend)):
        which = int(blend.dataset_index[index])
        inner = [dataset, other][which]
        tokens, _ = inner.sample_tokens(int(blend.dataset_sample_index[index]))
        assert rebuilt(sample_pieces(blend, index)) == tokens.tolist()


def _damage(path: Path, how: str, other: Path) -> None:
    data = bytearray(path.read_bytes())
    if how == "truncated":
        path.write_bytes(data[:-5])
    elif how == "flipped unit":
        data[-1 - 9 * 3] ^= 1  # a byte of the arrays: the sizes still agree
        path.write_bytes(bytes(data))
    elif how == "not a sidecar":
        path.write_bytes(b"{}\n")
    elif how == "another dataset's":
        shutil.copy(f"{other}.hp.sources", path)


@pytest.mark.parametrize("how", ["truncated", "flipped unit", "not a sidecar", "another dataset's"])
def test_a_damaged_or_mismatched_sidecar_is_refused_by_name(corpus, tmp_path, how):
    prefix = tmp_path / "copy"
    for suffix in (".bin", ".idx", ".hp.sources"):
        shutil.copy(f"{corpus['out']}{suffix}", f"{prefix}{suffix}")
    other = tmp_path / "other"  # a dataset of the same inputs: twice the documents
    merge_datasets(str(other), [str(corpus["out"])] * 2)
    _damage(Path(f"{prefix}.hp.sources"), how, other)
    with pytest.raises(ProvenanceError) as caught:
        document_source(str(prefix), [0])
    message = str(caught.value)
    assert message.startswith(f"{prefix}.hp.sources: ") and "\n" not in message
    result = CliRunner().invoke(main, ["inspect", str(prefix)])
    assert result.exit_code == 0, result.output  # the dataset itself is fine
    assert f"provenance unusable: {prefix}.hp.sources: " in result.output


def test_bad_arguments_get_one_line(corpus, tmp_path):
    count = len(corpus["reference"])
    for bad in ([count], [-1]):
        with pytest.raises(IndexError, match=f"out of range for {count} documents"):
            document_source(str(corpus["out"]), bad)
    missing = tmp_path / "none"
    with pytest.raises(ProvenanceError, match=f"^{missing}: no dataset here"):
        document_source(str(missing), [0])
    for source in ({"file": "x.jsonl"}, {"line": 3}, ["x.jsonl", 3]):
        with pytest.raises(HpDataError, match=r"^source .*: give a source as document_source"):
            source_text(source)
    changed = {"file": str(corpus["inputs"][0]), "line": 10**6}
    with pytest.raises(HpDataError, match=r"has no line 1000000; the input changed"):
        source_text(changed)


@pytest.mark.slow
def test_sidecar_and_idx_agree_after_a_kill_anywhere_in_a_merge(memory_dir, example_tokenizer):
    root = memory_dir / "kill"
    result = subprocess.run(
        [sys.executable, "-m", "tests.helpers.kill_anywhere", "merge-sources", str(root),
         str(example_tokenizer)],
        capture_output=True, text=True, cwd=ROOT, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    reports = [json.loads(line) for line in result.stdout.splitlines()]
    assert [r["killed"] for r in reports] == [True] * (len(reports) - 1) + [False]
    for report in reports:  # .bin, .idx, .hp.json and .hp.sources: all old or all new
        assert report["opened"] in ("old", "new"), report
        assert report["raw"] in ("old", "new") or report["journal"], report
        assert report["rerun"] == "new" and report["leftovers"] == [], report
    assert "new" in {r["opened"] for r in reports if r["journal"]}  # kills inside the commit
    assert [r["opened"] for r in reports].count("old") > 1
