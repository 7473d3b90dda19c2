"""Hostile corpora: what web-scale inputs really hold, with the verdict hp-data owes each line.

`hostile_lines(seed)` mixes good records that look odd (NUL characters, a byte-order mark,
CRLF endings, blank lines, an enormous line, non-ASCII text) with lines that must be refused
(lone surrogates escaped and raw, overlong numbers, deep nesting, Latin-1 bytes, records that
are not objects, missing keys, non-string texts, malformed JSON). Each line comes with the
reason hp-data must give for it (None: it must be written). `write_hostile` writes them in
any JSON-lines format; `hostile_table` is the Parquet counterpart (a table can only hold
non-string values and nulls wrongly), and `truncate` cuts a file at a random point.
"""

from __future__ import annotations

import gzip
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

BAD_LINES = [
    (b'{"text": "lone \\ud800 surrogate"}', "lone surrogate"),
    (b'{"text": "raw \xed\xa0\x80 surrogate"}', "lone surrogate"),
    (b'{"text": "x", "n": ' + b"7" * 5000 + b"}", "number too long"),
    (b"[" * 50_000 + b"]" * 50_000, "nested too deeply"),
    (b'{"text": "caf\xe9 in Latin-1"}', "invalid UTF-8"),
    (b'["a", "list"]', "not an object"),
    (b"42", "not an object"),
    (b'"just a string"', "not an object"),
    (b"null", "not an object"),
    (b'{"body": "no text key"}', "missing key"),
    (b'{"text": null}', "not a string"),
    (b'{"text": ["a"]}', "not a string"),
    (b'{"text": "unterminated', "malformed JSON"),
    (b'{"text": "x"} trailing', "malformed JSON"),
]


@dataclass
class HostileCorpus:
    """Lines (without their end of line) and, for each, the reason it is invalid or None."""

    lines: list[bytes]
    reasons: list[str | None]
    texts: list[str]  # the good records' texts, in order: what must be written

    def first_bad_line(self) -> tuple[int, str]:
        """1-based line number and reason of the first invalid line."""
        for number, reason in enumerate(self.reasons, 1):
            if reason is not None:
                return number, reason
        raise ValueError("no invalid line")

    def counts(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for reason in self.reasons:
            if reason is not None:
                counts[reason] = counts.get(reason, 0) + 1
        return counts

    def data(self, crlf_every: int = 3) -> bytes:
        """The file's bytes: some lines end in CRLF, and blank lines sit between some."""
        out = []
        for i, line in enumerate(self.lines):
            out.append(line + (b"\r\n" if i % crlf_every == 0 else b"\n"))
        return b"".join(out)


def hostile_lines(seed: int, good: int = 60, enormous: int = 300_000) -> HostileCorpus:
    """`good` odd but valid records with every bad line spread among them, in seeded order."""
    rng = np.random.default_rng(seed)
    words = ["naïve", "café", "日本語", "emoji 🙂", "tab\tseparated", "NUL \u0000 inside", "Ω"]
    records: list[tuple[bytes, str | None, str | None]] = []
    for i in range(good):
        text = f"record {i}: " + " ".join(rng.choice(words, int(rng.integers(1, 12))))
        if i == good // 2:
            text += " long" * (enormous // 5)  # one line far longer than a chunk
        records.append((json.dumps({"text": text}).encode(), None, text))
    for line, reason in BAD_LINES:
        records.insert(int(rng.integers(1, len(records))), (line, reason, None))
    lines = [line for line, _, _ in records]
    reasons = [reason for _, reason, _ in records]
    texts = [text for _, _, text in records if text is not None]
    # A byte-order mark on the first line (a good one: utf-8-sig is valid JSON text input).
    lines[0] = b"\xef\xbb\xbf" + lines[0]
    # Blank lines are not records: they count for line numbers only.
    blank = int(rng.integers(1, len(lines)))
    lines.insert(blank, b"   ")
    reasons.insert(blank, None)
    return HostileCorpus(lines, reasons, texts)


def write_hostile(directory: Path, corpus: HostileCorpus, fmt: str) -> Path:
    """The corpus as `c.jsonl`, `c.jsonl.gz` or `c.jsonl.zst` in `directory`."""
    data = corpus.data()
    path = directory / f"c.{fmt}"
    if fmt == "jsonl":
        path.write_bytes(data)
    elif fmt == "jsonl.gz":
        path.write_bytes(gzip.compress(data))
    else:
        import zstandard

        path.write_bytes(zstandard.ZstdCompressor(write_checksum=True).compress(data))
    return path


def hostile_table(directory: Path, seed: int, rows: int = 400) -> tuple[Path, list, list[str]]:
    """A Parquet file of texts with nulls, NULs and a huge value, several row groups; the
    column's values (None or a string) and the texts that must be written."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(seed)
    values: list[str | None] = []
    for i in range(rows):
        roll = rng.random()
        if roll < 0.05:
            values.append(None)
        elif roll < 0.1:
            values.append(f"nul \u0000 in row {i}")
        else:
            values.append(f"row {i} " + "🙂 café " * int(rng.integers(0, 30)))
    values[rows // 2] = "huge " * 60_000
    path = directory / "c.parquet"
    pq.write_table(pa.table({"text": values}), path, row_group_size=64)
    return path, values, [v for v in values if v is not None]


def truncate(path: Path, seed: int) -> float:
    """Cut `path` at a seeded point between 5% and 95% of its length; returns the fraction."""
    data = path.read_bytes()
    fraction = float(np.random.default_rng(seed).uniform(0.05, 0.95))
    path.write_bytes(data[: int(len(data) * fraction)])
    return fraction
