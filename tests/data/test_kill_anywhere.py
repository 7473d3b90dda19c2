"""A real SIGKILL before every filesystem step of preprocess, merge and build-index.

The final paths must hold the old complete dataset, the new complete one, or nothing, as hp
opens them; on disk, a mixed pair only ever sits beside the commit journal that hp finishes
on open. A rerun after any kill gives the bytes of an uninterrupted run, and leaves no hidden
directories behind. (The driver is `tests/helpers/kill_anywhere.py`.)
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _kill_everywhere(job: str, directory: Path, tokenizer: str) -> list[dict]:
    result = subprocess.run(
        [sys.executable, "-m", "tests.helpers.kill_anywhere", job, str(directory), tokenizer],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return [json.loads(line) for line in result.stdout.splitlines()]


@pytest.mark.slow
@pytest.mark.parametrize("job", ["preprocess", "merge", "merge-fresh"])
def test_datasets_are_old_or_new_after_a_kill_anywhere(tmp_path, example_tokenizer, job):
    reports = _kill_everywhere(job, tmp_path, str(example_tokenizer))
    before = "nothing" if job == "merge-fresh" else "old"  # what the final paths held
    assert [r["killed"] for r in reports] == [True] * (len(reports) - 1) + [False]
    assert len(reports) > 15  # every step of the shards, the final commit and the cleanup
    for report in reports:
        assert report["opened"] in (before, "new"), report
        assert report["raw"] in (before, "new") or report["journal"], report
        assert report["rerun"] == "new" and report["leftovers"] == [], report
    # Kills landed inside the commit, both before its rename (old) and after (new).
    committing = [r["opened"] for r in reports if r["journal"]]
    assert "new" in committing
    assert [r["opened"] for r in reports].count(before) > 1


@pytest.mark.slow
def test_the_index_cache_rebuilds_the_same_arrays_after_a_kill_anywhere(
    tmp_path, example_tokenizer
):
    reports = _kill_everywhere("build-index", tmp_path, str(example_tokenizer))
    assert [r["killed"] for r in reports] == [True] * (len(reports) - 1) + [False]
    assert len(reports) > 5  # the arrays and the description of two splits
    assert all(r["rerun"] == "new" for r in reports), reports
