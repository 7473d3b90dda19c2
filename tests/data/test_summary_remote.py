"""`hp-data inspect` of a URL prefix (issue 40): the dataset served over HTTP by the fault
server reports what the same files on disk report (the local inspect is the reference), a
missing prefix is one line, and `--check` finds a damaged `.bin` in the store (streamed whole
against the `.hp.json`'s block hashes), not damage on the way that a second read does not see."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest
from click.testing import CliRunner
from hp_data.cli import main

from tests.helpers.fault_http import Faults, fault_server
from tests.helpers.run import run_preprocess

SUFFIXES = (".bin", ".idx", ".hp.json", ".hp.sources")


@pytest.fixture(autouse=True)
def _cache_in_tmp(tmp_path, monkeypatch):
    """inspect's node cache (the temporary directory's) under this test's directory."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()


@pytest.fixture(scope="module")
def dataset(tmp_path_factory, example_corpus, example_tokenizer) -> str:
    """A preprocessed corpus: a tokenizer, provenance and block hashes recorded beside it."""
    out = tmp_path_factory.mktemp("inspect") / "docs"
    run_preprocess([example_corpus], out, example_tokenizer, append_eod=True)
    return str(out)


def _served(root: Path, prefix: str, damage: bool = False) -> Path:
    root.mkdir()
    for suffix in SUFFIXES:
        data = bytearray(Path(prefix + suffix).read_bytes())
        if damage and suffix == ".bin":
            data[len(data) // 3] ^= 0x01  # same size: only the block hashes can tell
        (root / f"docs{suffix}").write_bytes(bytes(data))
    return root


def _inspect(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(main, ["inspect", *args])
    assert "Traceback" not in result.output
    return result.exit_code, result.output


def test_a_url_reports_what_the_local_copy_reports(tmp_path, dataset):
    code, local = _inspect(dataset, "--json", "--show", "2", "--check")
    assert code == 0
    reference = json.loads(local)
    assert reference["provenance"]["inputs"] == 1 and reference["tokenizer"] is not None
    with fault_server(_served(tmp_path / "served", dataset)) as server:
        url = server.url("docs")
        code, remote = _inspect(url, "--json", "--show", "2", "--check")
        assert code == 0, remote
        code, text = _inspect(url)
        assert code == 0
    assert json.loads(remote) == {**reference, "prefix": url}
    _, local_text = _inspect(dataset)
    assert text == local_text.replace(dataset, url)


def test_a_missing_prefix_is_one_line(tmp_path, dataset):
    with fault_server(_served(tmp_path / "served", dataset)) as server:
        for args in ([], ["--check"]):
            code, output = _inspect(server.url("nothing"), *args)
            assert code == 1
            lines = output.strip().splitlines()
            assert lines[-1].strip().endswith(f"{server.url('nothing.idx')}: no such dataset")
            assert len(lines) == 1 + bool(args)  # --check: its count line, then the problem


def test_check_of_a_url_finds_a_damaged_bin(tmp_path, dataset):
    size = Path(dataset + ".bin").stat().st_size
    with fault_server(_served(tmp_path / "served", dataset, damage=True)) as server:
        code, output = _inspect(server.url("docs"), "--check")
    assert code == 1
    block = 4 << 20  # one block holds this corpus whole (bytes 0 to the block's end)
    assert size < block
    assert output.splitlines() == [
        "1 problem(s):",
        f"  {server.url('docs.bin')}: bytes 0-{block:,} (block 0) differ from what was written "
        f"({server.url('docs.hp.json')}: bin_blocks) on two reads: the store's .bin is not the "
        "one hp-data wrote; upload it again",
    ]


def test_check_of_a_url_reads_again_past_damage_on_the_way(tmp_path, dataset):
    faults = Faults(flip={"/docs.bin": 1})  # the first read's body damaged in transit
    with fault_server(_served(tmp_path / "served", dataset), faults) as server:
        code, output = _inspect(server.url("docs"), "--check")
        assert faults.flip == {"/docs.bin": 0}  # the damage was served
        faults.flip["/docs.bin"] = 1000  # every read damaged: the store's problem, then
        damaged, again = _inspect(server.url("docs"), "--check")
    assert code == 0, output
    assert output.splitlines()[-1] == "check: ok, every invariant holds"
    assert damaged == 1 and "on two reads" in again


def test_cache_dir_is_where_a_url_is_cached_and_a_bad_one_falls_back(tmp_path, dataset):
    """`inspect --cache-dir DIR`: a URL prefix's .idx lands under DIR (and nothing under the
    shared temporary cache); a DIR the user's file stands at is left alone, with one warning
    naming it, and the report read through the temporary cache is the same."""
    cache, mine = tmp_path / "cache", tmp_path / "notes.txt"
    mine.write_text("the user's own file")
    with fault_server(_served(tmp_path / "served", dataset)) as server:
        url = server.url("docs")
        code, first = _inspect(url, "--json", "--check", "--cache-dir", str(cache))
        assert code == 0, first
        assert list(cache.rglob("*.idx")) and not list((tmp_path / "tmp").rglob("*.idx"))
        result = CliRunner().invoke(main, ["inspect", url, "--json", "--cache-dir", str(mine)])
    assert result.exit_code == 0 and "Traceback" not in result.output
    assert mine.read_text() == "the user's own file"
    assert json.loads(result.stdout) == json.loads(first)
