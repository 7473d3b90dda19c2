"""The proven tiktoken recipe kept on disk (hp_data/recipe_cache.py): a later run reads it and
writes `tokenizers`' bytes; whatever is in the cache directory that is not this tokenizer's
recipe (damaged, another tokenizer's, an older proof's, the user's own files) is never used
and never deleted; a cache that cannot be written keeps nothing and the run goes on."""

from __future__ import annotations

import json
import os
import shutil
import zipfile
from pathlib import Path

import numpy as np
import pytest
from hp_data import recipe_cache
from hp_data.fast_bpe import FastBPE
from hp_data.tokenize import TokenizerFiles

from tests.helpers.bpe import (
    LLAMA3_PATTERN,
    convert_ranks,
    corpus_texts,
    rank_table,
    train_llama3_style,
)
from tests.helpers.run import read_bytes, run_preprocess


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    directory = tmp_path / "cache"
    monkeypatch.setenv(recipe_cache.ENV, str(directory))
    return directory


@pytest.fixture(scope="module")
def reference(tmp_path_factory, example_corpus, example_tokenizer) -> tuple[bytes, ...]:
    """`tokenizers`' own bytes for the example corpus: what every run here must write."""
    out = tmp_path_factory.mktemp("hf") / "out"
    run_preprocess([example_corpus], out, example_tokenizer, tokenizer_engine="hf")
    return read_bytes(out)


def _run(tmp_path: Path, corpus, tokenizer, name: str, **options):
    summary = run_preprocess([corpus], tmp_path / name, tokenizer, **options)
    return summary, read_bytes(tmp_path / name)


def _kept(cache: Path) -> list[Path]:
    return sorted(cache.glob("*.npz"))


def _same(a: FastBPE, b: FastBPE) -> bool:
    return (a.pattern, a.ranks, a.specials) == (b.pattern, b.ranks, b.specials) and (
        np.array_equal(a.ids, b.ids)
    )


def test_a_second_run_reads_the_kept_recipe(tmp_path, cache, example_corpus, example_tokenizer,
                                            reference):  # fmt: skip
    first, written = _run(tmp_path, example_corpus, example_tokenizer, "a", workers=2)
    assert first.engine == "tiktoken" and written == reference
    (kept,) = _kept(cache)
    digest = TokenizerFiles.locate(str(example_tokenizer)).content_hash()
    assert kept.name.startswith(digest)
    fresh = FastBPE.from_tokenizer_json(example_tokenizer)  # converted here, not through the cache
    assert _same(FastBPE.load(str(kept), digest), fresh)
    stamp = kept.stat().st_mtime_ns
    second, again = _run(tmp_path, example_corpus, example_tokenizer, "b", workers=2)
    assert second.engine == "tiktoken" and again == reference
    assert kept.stat().st_mtime_ns == stamp  # read, not made again


def test_a_converted_tokenizer_round_trips(tmp_path, example_corpus):
    texts = corpus_texts(example_corpus)
    trained = train_llama3_style(texts, tmp_path / "trained.json", vocab_size=1500)
    path = convert_ranks(rank_table(trained), LLAMA3_PATTERN, ["<|end_of_text|>"],
                         tmp_path / "converted.json")  # fmt: skip
    recipe = FastBPE.from_tokenizer_json(path)
    with open(tmp_path / "r.npz", "wb") as stream:
        recipe.save(stream, "abc")
    assert _same(FastBPE.load(str(tmp_path / "r.npz"), "abc"), recipe)
    with pytest.raises(ValueError, match="another tokenizer"):
        FastBPE.load(str(tmp_path / "r.npz"), "abd")


def _damage(path: Path, how: str) -> None:
    data = bytearray(path.read_bytes())
    if how == "truncated":
        path.write_bytes(bytes(data[: len(data) // 2]))
    elif how == "flipped":  # inside the ranks' bytes: only zip's CRC can tell
        at = len(data) // 2
        data[at] ^= 0x20
        path.write_bytes(bytes(data))
    elif how == "empty":
        path.write_bytes(b"")
    elif how == "not a zip":
        path.write_bytes(b"\x93NUMPY" + bytes(200))
    elif how == "older proof":
        with np.load(path) as arrays:
            members = dict(arrays)
        meta = json.loads(members["meta"].tobytes())
        members["meta"] = np.frombuffer(json.dumps({**meta, "proof": 1}).encode(), np.uint8)
        with open(path, "wb") as stream:
            np.savez(stream, **members)
    elif how == "members missing":
        with zipfile.ZipFile(path, "w") as archive:
            archive.writestr("meta.npy", b"")


@pytest.mark.parametrize(
    "how", ["truncated", "flipped", "empty", "not a zip", "older proof", "members missing"]
)
def test_a_damaged_recipe_is_made_again(tmp_path, cache, example_corpus, example_tokenizer,
                                        reference, how):  # fmt: skip
    _run(tmp_path, example_corpus, example_tokenizer, "a")
    (kept,) = _kept(cache)
    digest = kept.name.split("-")[0]
    _damage(kept, how)
    assert recipe_cache.load(str(kept), digest) is None
    summary, written = _run(tmp_path, example_corpus, example_tokenizer, "b")
    assert summary.engine == "tiktoken" and written == reference
    assert recipe_cache.load(str(kept), digest) is not None  # made again, whole


def test_another_tokenizers_recipe_is_not_taken(tmp_path, cache, example_corpus,
                                                example_tokenizer, reference):  # fmt: skip
    other = tmp_path / "other.json"
    described = json.loads(example_tokenizer.read_text())
    described["model"]["merges"] = described["model"]["merges"][:-50]
    other.write_text(json.dumps(described))
    _run(tmp_path, example_corpus, other, "other")
    (theirs,) = _kept(cache)
    digest = TokenizerFiles.locate(str(example_tokenizer)).content_hash()
    mine = theirs.with_name(theirs.name.replace(theirs.name.split("-")[0], digest))
    shutil.copy(theirs, mine)  # another tokenizer's recipe under this one's name
    summary, written = _run(tmp_path, example_corpus, example_tokenizer, "a", workers=2)
    assert summary.engine == "tiktoken" and written == reference
    assert recipe_cache.load(str(mine), digest) is not None  # made again for this tokenizer


def test_the_users_files_in_the_cache_directory_stay(tmp_path, cache, example_corpus,
                                                     example_tokenizer, reference):  # fmt: skip
    cache.mkdir()
    own = {"notes.txt": b"mine", "model.npz": b"not a recipe", "sub/deep.bin": b"\x00" * 9}
    for name, data in own.items():
        (cache / name).parent.mkdir(parents=True, exist_ok=True)
        (cache / name).write_bytes(data)
    for name in ("a", "b"):
        assert _run(tmp_path, example_corpus, example_tokenizer, name)[1] == reference
    assert {name: (cache / name).read_bytes() for name in own} == own
    found = {str(p.relative_to(cache)) for p in cache.rglob("*") if p.is_file()}
    digest = TokenizerFiles.locate(str(example_tokenizer)).content_hash()
    assert found - set(own) == {Path(recipe_cache.recipe_path(digest)).name}  # nothing else


@pytest.mark.parametrize("where", ["off", "under a file", "read-only"])
def test_an_unwritable_cache_keeps_nothing(
    tmp_path, monkeypatch, example_corpus, example_tokenizer, reference, where
):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    read_only = tmp_path / "read-only"
    read_only.mkdir()
    value = {"off": "off", "under a file": str(blocker / "cache"), "read-only": str(read_only)}
    monkeypatch.setenv(recipe_cache.ENV, value[where])
    if where == "read-only":
        read_only.chmod(0o555)
        if os.access(read_only, os.W_OK):  # root writes anywhere: nothing to test here
            pytest.skip("this user writes into read-only directories")
    for name in ("a", "b"):
        summary, written = _run(tmp_path, example_corpus, example_tokenizer, name)
        assert summary.engine == "tiktoken" and written == reference
    assert blocker.read_text() == "x"
    assert list(read_only.iterdir()) == []


def test_the_default_place(monkeypatch, tmp_path):
    monkeypatch.delenv(recipe_cache.ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert recipe_cache.cache_dir() == str(tmp_path / "hp-data" / "tokenizers")
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert recipe_cache.cache_dir() == str(tmp_path / "home" / ".cache" / "hp-data" / "tokenizers")
