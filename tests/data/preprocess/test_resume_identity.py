"""A resumed run reuses a finished unit only while its input is the same file (issue 40): an
input replaced atomically (written, then renamed over) by one of the same size and mtime is
another inode, and is processed again; a work directory an older hp-data wrote (no inode in its
records) is still resumed while its inputs have not changed. The reference for every output is
a fresh run over the same inputs."""

from __future__ import annotations

import json
import os

import pytest
from hp_data.errors import PreprocessError

from tests.helpers.run import read_bytes, run_preprocess


def _manifest(out) -> dict:
    return json.loads((out.parent / f".{out.name}.hp-preprocess" / "manifest.json").read_text())


@pytest.mark.parametrize("change", ["none", "old record", "replaced"])
def test_resume_reuses_a_unit_only_of_the_same_file(tmp_path, example_corpus, example_tokenizer,
                                                    change):  # fmt: skip
    lines = example_corpus.read_text(encoding="utf-8").splitlines(keepends=True)
    inputs = tmp_path / "in"
    inputs.mkdir()
    first, second = inputs / "a.jsonl", inputs / "b.jsonl"
    first.write_text("".join(lines[:150]), encoding="utf-8")
    second.write_text("".join(lines[150:300]) + "not json\n", encoding="utf-8")
    out = tmp_path / "out"
    # The second input's bad line stops the run after the first is finished: the work
    # directory stays, with the first input's unit in it.
    with pytest.raises(PreprocessError, match="b.jsonl"):
        run_preprocess([first, second], out, example_tokenizer)
    manifest_path = out.parent / f".{out.name}.hp-preprocess" / "manifest.json"
    records = _manifest(out)["shards"]
    assert [r["inode"] for r in records] == [os.stat(first).st_ino]
    second.write_text("".join(lines[150:300]), encoding="utf-8")  # fixed: the rerun goes on

    if change == "old record":  # as hp-data wrote it before it kept inodes
        manifest = _manifest(out)
        manifest["shards"] = [{"identity": r["identity"], "stats": r["stats"]} for r in records]
        manifest_path.write_text(json.dumps(manifest))
    elif change == "replaced":  # other bytes, the same size and mtime, renamed over it
        before = os.stat(first)
        replacement = inputs / "a.jsonl.new"
        replacement.write_text("".join(reversed(lines[:150])), encoding="utf-8")
        os.utime(replacement, ns=(before.st_atime_ns, before.st_mtime_ns))
        os.replace(replacement, first)
        after = os.stat(first)
        assert (after.st_size, after.st_mtime_ns) == (before.st_size, before.st_mtime_ns)
        assert after.st_ino != before.st_ino

    summary = run_preprocess([first, second], out, example_tokenizer)
    assert summary.resumed_shards == (0 if change == "replaced" else len(records))
    reference = tmp_path / "reference"
    run_preprocess([first, second], reference, example_tokenizer)
    assert read_bytes(out, metadata=True) == read_bytes(reference, metadata=True)
    assert not manifest_path.parent.exists()
