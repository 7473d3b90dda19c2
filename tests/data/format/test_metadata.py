"""`PREFIX.hp.json` travels with its tokens: written, replaced, removed and merged with them."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import xxhash
from hp_data import IndexedDataset, IndexedDatasetBuilder, IndexedDatasetError, merge_datasets
from hp_data.format import expand_prefixes
from hp_data.format.metadata import read_metadata
from hp_data.format.validate import dataset_problems

from tests.helpers.corpus import random_corpus, write_with_hp


def _made_with(hash_: str, eod: int | None = 0) -> dict:
    tokenizer = {"source": "t.json", "path": "/t.json", "xxh3_128": hash_}
    return {"schema": 1, "tokenizer": tokenizer, "eod": eod, "bos": None}


def _recorded(prefix: str | Path, described: dict | None) -> dict:
    """What `PREFIX.hp.json` holds: `described` (what made the tokens) and the block hashes of
    the `.bin` beside it (hashed here; one 4 MiB block at these sizes)."""
    data = Path(f"{prefix}.bin").read_bytes()
    blocks = {"block_bytes": 4 << 20, "xxh3_64": xxhash.xxh3_64_hexdigest(data)}
    return {**(described or {"schema": 1}), "bin_blocks": blocks}


def _write(prefix: Path, seed: int, metadata: dict | None) -> str:
    with IndexedDatasetBuilder(prefix, np.uint16, metadata=metadata) as builder:
        for document in random_corpus(seed, np.uint16).documents:
            for sequence in document:
                builder.add_item(sequence)
            builder.end_document()
    return str(prefix)


def test_the_metadata_is_written_with_the_dataset_and_goes_when_it_is_rewritten_without(
    tmp_path,
):
    prefix = _write(tmp_path / "ds", 1, _made_with("a" * 32))
    assert json.loads(Path(prefix + ".hp.json").read_text()) == _recorded(
        prefix, _made_with("a" * 32)
    )
    assert read_metadata(prefix) == _recorded(prefix, _made_with("a" * 32))
    _write(tmp_path / "ds", 2, None)  # new tokens, nothing known about them but their hashes
    assert read_metadata(prefix) == _recorded(prefix, None)
    assert "tokenizer" not in Path(prefix + ".hp.json").read_text()
    assert len(IndexedDataset(prefix)) == sum(len(d) for d in random_corpus(2, np.uint16).documents)


def test_a_failed_rewrite_keeps_the_old_metadata(tmp_path):
    prefix = _write(tmp_path / "ds", 1, _made_with("a" * 32))
    with pytest.raises(RuntimeError), IndexedDatasetBuilder(prefix, np.uint16) as builder:
        builder.add_item([1, 2, 3])
        raise RuntimeError("killed halfway")
    assert read_metadata(prefix) == _recorded(prefix, _made_with("a" * 32))


@pytest.mark.parametrize(
    ("others", "kept"),
    [
        ([_made_with("a" * 32)], True),
        ([_made_with("b" * 32)], False),  # another tokenizer
        ([_made_with("a" * 32, eod=None)], False),  # the same one, without EOD
        ([None], False),  # unknown: made without a tokenizer's record
    ],
)
def test_a_merge_records_the_tokenizer_only_when_every_input_shares_it(tmp_path, others, kept):
    first = _write(tmp_path / "in0", 0, _made_with("a" * 32))
    rest = [_write(tmp_path / f"in{i + 1}", i + 1, m) for i, m in enumerate(others)]
    merge_datasets(str(tmp_path / "out"), [first, *rest])
    out = tmp_path / "out"
    assert read_metadata(out) == _recorded(out, _made_with("a" * 32) if kept else None)


def test_a_glob_over_datasets_skips_their_metadata(tmp_path):
    prefixes = [_write(tmp_path / f"code-{i}", i, _made_with("a" * 32)) for i in range(2)]
    assert expand_prefixes([str(tmp_path / "code-*")]) == prefixes
    merge_datasets(str(tmp_path / "all"), expand_prefixes([str(tmp_path / "code-*")]))
    assert read_metadata(tmp_path / "all") == _recorded(tmp_path / "all", _made_with("a" * 32))


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("{not json", "not valid JSON"),
        ('{"tokenizer": {}}', "no integer 'schema' key"),
        ('{"schema": 2}', "schema 2 is newer than this hp-data reads (1); upgrade hp-data"),
    ],
)
def test_a_bad_metadata_file_is_named_and_listed_by_check(tmp_path, text, message):
    prefix = write_with_hp(str(tmp_path / "ds"), random_corpus(0, np.uint16))
    Path(prefix + ".hp.json").write_text(text)
    with pytest.raises(IndexedDatasetError, match="ds.hp.json: ") as error:
        read_metadata(prefix)
    assert message in str(error.value)
    assert dataset_problems(prefix) == [str(error.value)]
