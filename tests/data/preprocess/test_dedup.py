"""--dedup exact drops exactly the documents whose normalised text was seen before."""

from __future__ import annotations

import unicodedata

import numpy as np
from hp_data import IndexedDataset
from hp_data.dedup import HashSet
from tokenizers import Tokenizer

from tests.helpers.corpus_files import english_records, write_jsonl
from tests.helpers.run import read_bytes, run_preprocess


def test_hash_set_agrees_with_a_python_set():
    rng = np.random.default_rng(5)
    table, reference = HashSet(capacity=16), set()
    previous = np.empty((0, 2), np.uint64)
    for _ in range(40):  # grows many times from 16 slots
        batch = rng.integers(0, 2**64, (700, 2), dtype=np.uint64, endpoint=False)
        batch[:50] = batch[50:100]  # repeats inside the batch
        if len(previous):
            batch[100:200] = previous[rng.integers(0, len(previous), 100)]  # and across
        batch[300] = (0, 0)  # the value the table uses for "empty" is still a valid hash
        expected = []
        for row in map(tuple, batch.tolist()):
            expected.append(row not in reference)
            reference.add(row)
        assert table.add_new(batch).tolist() == expected
        previous = batch
    assert len(table) == len(reference)
    assert table.nbytes <= 16 * 4 * len(reference)


def _normalised(text: str) -> str:
    return " ".join(unicodedata.normalize("NFC", text).split())


def test_dedup_drops_exactly_the_duplicates(tmp_path, example_tokenizer):
    records = english_records(8, 300)
    texts = [r["text"] for r in records]
    texts[10] = texts[3]  # an exact copy
    texts[20] = "  " + texts[5].replace(" ", "\n\t ") + " "  # the same words, other spacing
    texts[30] = unicodedata.normalize("NFD", "café au lait")  # decomposed é ...
    texts[31] = unicodedata.normalize("NFC", "café au lait")  # ... equals composed é
    texts[40] = texts[5].upper()  # case differs: not a duplicate
    first = write_jsonl(tmp_path / "a.jsonl", [{"text": t} for t in texts[:150]])
    second = write_jsonl(tmp_path / "b.jsonl", [{"text": t} for t in texts[150:] + texts[:5]])
    summary = run_preprocess(
        [first, second],
        tmp_path / "out",
        example_tokenizer,
        dedup="exact",
        append_eod=True,
        chunk_bytes=2000,
        workers=2,
    )

    seen, kept = set(), []
    for text in texts + texts[:5]:
        key = _normalised(text)
        if text and key not in seen:  # empty texts are skipped before deduplication
            seen.add(key)
            kept.append(text)
    duplicates = sum(1 for t in texts + texts[:5] if t) - len(kept)
    assert duplicates >= 9  # the copies made above, and the five repeated across files
    assert summary.skipped["duplicate"] == duplicates
    assert summary.dedup_hash_set_bytes >= 16 * len(kept)
    tokenizer = Tokenizer.from_file(str(example_tokenizer))
    eod = tokenizer.token_to_id("<|endoftext|>")
    ds = IndexedDataset(tmp_path / "out")
    assert ds.num_documents == len(kept) == summary.documents_written
    for d, text in enumerate(kept):
        assert ds.get_document(d).tolist() == tokenizer.encode(text).ids + [eod]

    again = run_preprocess(
        [first, second],
        tmp_path / "one",
        example_tokenizer,
        dedup="exact",
        append_eod=True,
        workers=1,
    )
    assert read_bytes(tmp_path / "one") == read_bytes(tmp_path / "out")
    assert again.skipped["duplicate"] == duplicates
