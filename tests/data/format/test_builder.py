"""The builder refuses bad tokens, stays small in memory, and never leaves half a dataset."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
from hp_data import IndexedDataset, IndexedDatasetBuilder, IndexedDatasetError

from tests.helpers.corpus import random_corpus, write_with_hp


def _leftovers(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


@pytest.mark.parametrize(
    ("dtype", "tokens", "bad"),
    [
        (np.uint16, [1, 65536], "65536"),
        (np.uint16, [-1, 3], "-1"),
        (np.int8, np.array([127, 128], dtype=np.int64), "128"),
        (np.int32, [2**31], str(2**31)),
        (np.uint8, np.array([300], dtype=np.int32), "300"),
    ],
)
def test_out_of_range_tokens_are_rejected(tmp_path, dtype, tokens, bad):
    builder = IndexedDatasetBuilder(tmp_path / "ds", dtype)
    with pytest.raises(IndexedDatasetError, match=f"token id {bad} does not fit"):
        builder.add_item(tokens)
    with pytest.raises(IndexedDatasetError, match=f"token id {bad} does not fit"):
        builder.add_document(tokens, [len(tokens)])
    builder.abort()
    assert _leftovers(tmp_path) == []


def test_non_integer_tokens_are_rejected(tmp_path):
    with IndexedDatasetBuilder(tmp_path / "ds", np.int32) as builder:
        with pytest.raises(IndexedDatasetError, match="must be integers"):
            builder.add_item([1.5, 2.0])
        builder.add_item(np.array([1, 2], dtype=np.uint8))  # widening is fine
    assert IndexedDataset(tmp_path / "ds")[0].tolist() == [1, 2]


def test_add_document_checks_lengths(tmp_path):
    with IndexedDatasetBuilder(tmp_path / "ds", np.uint16) as builder:
        with pytest.raises(IndexedDatasetError, match="lengths sum to 3 but there are 4 tokens"):
            builder.add_document([1, 2, 3, 4], [1, 2])
        with pytest.raises(IndexedDatasetError, match="between 0 and"):
            builder.add_document([1, 2], [3, -1])
        builder.add_document([1, 2, 3, 4], [1, 3])
    ds = IndexedDataset(tmp_path / "ds")
    assert ds.sequence_lengths.tolist() == [1, 3]
    assert ds.num_documents == 1


def test_add_documents_equals_one_add_document_each(tmp_path):
    docs = [np.arange(n, dtype=np.int64) for n in (3, 1, 5, 2)]
    with IndexedDatasetBuilder(tmp_path / "one", np.uint16) as builder:
        for doc in docs:
            builder.add_document(doc, [len(doc)])
    with IndexedDatasetBuilder(tmp_path / "bulk", np.uint16) as builder:
        builder.add_documents(np.concatenate(docs), [len(d) for d in docs])
    for suffix in (".bin", ".idx"):
        assert (tmp_path / f"one{suffix}").read_bytes() == (tmp_path / f"bulk{suffix}").read_bytes()


def test_add_index_concatenates_and_checks_dtype(tmp_path):
    a = write_with_hp(str(tmp_path / "a"), random_corpus(1, np.uint16))
    b = write_with_hp(str(tmp_path / "b"), random_corpus(2, np.uint16))
    c = write_with_hp(str(tmp_path / "c"), random_corpus(3, np.int32))
    with IndexedDatasetBuilder(tmp_path / "ab", np.uint16) as builder:
        builder.add_index(a)
        builder.add_index(b)
        with pytest.raises(IndexedDatasetError, match="dtype int32 differs from the output's"):
            builder.add_index(c)
    ab, da, db = (IndexedDataset(p) for p in (tmp_path / "ab", a, b))
    assert ab.num_documents == da.num_documents + db.num_documents
    for d in range(ab.num_documents):
        source, index = (da, d) if d < da.num_documents else (db, d - da.num_documents)
        np.testing.assert_array_equal(ab.get_document(d), source.get_document(index))


def test_an_exception_leaves_nothing_at_the_final_path(tmp_path):
    with (
        pytest.raises(RuntimeError, match="boom"),
        IndexedDatasetBuilder(tmp_path / "ds", np.uint16) as builder,
    ):
        for _ in range(1000):
            builder.add_item(np.arange(100))
        raise RuntimeError("boom")
    assert _leftovers(tmp_path) == []


def test_a_failed_rebuild_keeps_the_old_dataset(tmp_path):
    old = write_with_hp(str(tmp_path / "ds"), random_corpus(1, np.uint16))
    before = Path(old + ".bin").read_bytes(), Path(old + ".idx").read_bytes()
    with pytest.raises(IndexedDatasetError), IndexedDatasetBuilder(old, np.uint16) as builder:
        builder.add_item([1, 2, 3])
        builder.add_item([70000])
    assert (Path(old + ".bin").read_bytes(), Path(old + ".idx").read_bytes()) == before


def test_a_finalized_builder_refuses_more(tmp_path):
    builder = IndexedDatasetBuilder(tmp_path / "ds", np.uint16)
    builder.add_item([1])
    builder.finalize()
    with pytest.raises(IndexedDatasetError, match="already finalized"):
        builder.add_item([2])


@pytest.mark.parametrize("when", ["while adding", "before the index is renamed"])
def test_sigkill_leaves_nothing_at_the_final_path(tmp_path, when):
    """A killed process cannot clean up: the final path must simply never have been written."""
    hook = (
        "builder._write_index = lambda index: os.kill(os.getpid(), signal.SIGKILL)"
        if when == "before the index is renamed"
        else "pass"
    )
    script = textwrap.dedent(f"""
        import os, signal
        import numpy as np
        from hp_data import IndexedDatasetBuilder
        builder = IndexedDatasetBuilder({str(tmp_path / "ds")!r}, np.uint16)
        {hook}
        for i in range(20000):
            builder.add_item(np.arange(50))
            if i == 10000 and {when == "while adding"!r}:
                os.kill(os.getpid(), signal.SIGKILL)
        builder.finalize()
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=120)
    assert result.returncode == -9, result.stderr.decode()
    assert not (tmp_path / "ds.bin").exists()
    assert not (tmp_path / "ds.idx").exists()
    # Only the hidden temporary directory remains, and it is named after the output.
    assert all(name.startswith(".ds.hp-tmp-") for name in _leftovers(tmp_path))


def test_memory_stays_flat_in_the_number_of_sequences(tmp_path):
    """Lengths and boundaries spill to disk: no Python object per sequence or document."""
    tokens = np.arange(8, dtype=np.uint16)
    tracemalloc.start()
    with IndexedDatasetBuilder(tmp_path / "ds", np.uint16) as builder:
        for _ in range(300_000):
            builder.add_item(tokens)
            builder.end_document()
        _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    # Lists of 300k lengths and boundaries would hold over 10 MB of Python ints.
    assert peak < 3 << 20, f"peak traced memory {peak / 1e6:.1f} MB"
    ds = IndexedDataset(tmp_path / "ds")
    assert (len(ds), ds.num_documents) == (300_000, 300_000)
    assert int(ds.sequence_pointers[-1]) == (300_000 - 1) * 8 * 2


def test_creates_the_output_directory(tmp_path):
    with IndexedDatasetBuilder(tmp_path / "new" / "dir" / "ds", np.uint16) as builder:
        builder.add_item([1])
    assert IndexedDataset(tmp_path / "new" / "dir" / "ds")[0].tolist() == [1]
    assert sorted(os.listdir(tmp_path / "new" / "dir")) == ["ds.bin", "ds.hp.json", "ds.idx"]
