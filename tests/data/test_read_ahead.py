"""What the read-ahead is told to fetch (`chunks_for`) against what reading the samples really
reads: every chunk that reading sample i maps (the reader's own record) is named for it, and
nothing else, for a blend and a single prefix, across 4 KiB chunk boundaries."""

from __future__ import annotations

from hp_data.blend import build_split
from hp_data.gpt import GPTDatasetConfig
from hp_data.object_store import RemoteCorpus

from tests.helpers.object_store import CHUNK_MB, upload_memory, write_corpus


def test_chunks_for_names_the_chunks_each_sample_reads(tmp_path, monkeypatch):
    upload_memory("told", {n: write_corpus(tmp_path / n, k, count=80) for k, n in enumerate("ac")})
    read: set[tuple[str, int]] = set()
    view = RemoteCorpus._view

    def recorded(self: RemoteCorpus, chunk: int):
        read.add((self.directory, chunk))
        return view(self, chunk)

    monkeypatch.setattr(RemoteCorpus, "_view", recorded)
    config = GPTDatasetConfig(seq_length=24, split="1,0,0", cache_dir=str(tmp_path / "cache"),
                              remote_chunk_mb=CHUNK_MB)  # fmt: skip
    for spec in ("0.6 memory://told/a 0.4 memory://told/c", "memory://told/a"):
        dataset = build_split(spec, config, "train", 200)
        straddle = 0
        for i in range(len(dataset)):
            read.clear()
            dataset[i]
            told = {(corpus.directory, chunk) for corpus, chunk in dataset.chunks_for([i])}
            assert told == read, f"{spec}: sample {i}"
            straddle += len({chunk for _, chunk in read}) > 1
        assert straddle  # some samples read two chunks
